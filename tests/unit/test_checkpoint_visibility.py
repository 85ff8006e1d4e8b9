"""A checkpoint_dir that is not shared by every node is refused before the first commit:
the decision (`unseen_files`, `still_unseen`) on a real directory. (Two real agents on
their own disks, and the look-again delays: tests/integration/test_checkpoint_visibility.py.)
"""

from __future__ import annotations

from builders import file_reports, write_file

from unbroken.checkpoint.manifest import Unseen, still_unseen, unseen_files
from unbroken.checkpoint.persist import check_visible


def test_every_file_there_as_reported_is_seen(tmp_path):
    write_file(tmp_path, "__0_0.distcp", 10)
    write_file(tmp_path, "__1_0.distcp", 0)
    reports = file_reports({"__0_0.distcp": 10}, {"__1_0.distcp": 0})
    assert unseen_files(tmp_path, reports) == []
    check_visible(tmp_path, reports, str(tmp_path), look_again=())
    assert unseen_files(tmp_path, [{"ok": False, "error": "x"}]) == []  # a report without files


def test_a_missing_file_and_one_of_another_size_are_unseen(tmp_path):
    write_file(tmp_path, "__0_0.distcp", 10)
    write_file(tmp_path, "__1_0.distcp", 7)  # rank 1 reported 12 bytes
    reports = file_reports({"__0_0.distcp": 10}, {"__1_0.distcp": 12}, {"__2_0.distcp": 5})
    unseen = unseen_files(tmp_path, reports)
    assert unseen == [Unseen(1, "__1_0.distcp", 12, 7), Unseen(2, "__2_0.distcp", 5, None)]
    assert [u.describe() for u in unseen] == ["rank 1's __1_0.distcp (7 of its 12 bytes)",
                                             "rank 2's __2_0.distcp"]
    write_file(tmp_path, "__2_0.distcp", 5)  # shown late, as a slow shared filesystem might
    assert still_unseen(tmp_path, unseen) == [Unseen(1, "__1_0.distcp", 12, 7)]
    assert list(p.name for p in tmp_path.iterdir()).count("__1_0.distcp") == 1  # nothing changed
