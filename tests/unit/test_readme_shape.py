"""The README is for users: at most 300 lines of at most 100 columns (table rows excepted),
and what has run where (CPU with gloo, one GPU, several GPUs) in its first 40 lines."""

from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def test_the_readme_is_short_and_narrow():
    lines = README.read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines (at most 300)"
    wide = [i + 1 for i, line in enumerate(lines) if len(line) > 100 and not line.startswith("|")]
    assert not wide, f"README.md lines wider than 100 columns: {wide}"


def test_what_has_run_where_comes_first():
    head = "\n".join(README.read_text().splitlines()[:40])
    assert "| where | what has run |" in head
    for where in ("| CPU, gloo |", "| one GPU, NCCL |", "| several GPUs, NCCL |"):
        assert where in head, where
