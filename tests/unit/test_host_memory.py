"""The memory the runtime plans host copies against (host_memory.py): the room under the
process's cgroup limit where that is less than the host's MemAvailable (a pod's memory
limit), read from cgroup v2 and v1 files laid out as the kernel does, in a temp dir."""

from __future__ import annotations

from unbroken.host_memory import cgroup_room

GI = 2**30


def write(path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_v2_the_pods_limit_less_its_usage(tmp_path):
    proc = tmp_path / "proc_cgroup"
    write(proc, "0::/kubepods/pod1/ctr\n")
    pod = tmp_path / "cg" / "kubepods" / "pod1"
    write(pod / "ctr" / "memory.max", "max\n")  # the container: no limit of its own
    write(pod / "ctr" / "memory.current", "100\n")
    write(pod / "memory.max", f"{64 * GI}\n")  # the pod's
    write(pod / "memory.current", f"{60 * GI}\n")
    assert cgroup_room(tmp_path / "cg", proc) == 4 * GI


def test_v2_inside_a_container_its_root_is_the_cgroup(tmp_path):
    proc = tmp_path / "proc_cgroup"
    write(proc, "0::/\n")
    write(tmp_path / "cg" / "memory.max", f"{8 * GI}\n")
    write(tmp_path / "cg" / "memory.current", f"{2 * GI}\n")
    assert cgroup_room(tmp_path / "cg", proc) == 6 * GI


def test_v1_and_no_limit(tmp_path):
    proc = tmp_path / "proc_cgroup"
    write(proc, "4:memory:/job\n0::/\n")
    mem = tmp_path / "cg" / "memory" / "job"
    write(mem / "memory.limit_in_bytes", f"{16 * GI}\n")
    write(mem / "memory.usage_in_bytes", f"{GI}\n")
    assert cgroup_room(tmp_path / "cg", proc) == 15 * GI
    write(mem / "memory.limit_in_bytes", "9223372036854771712\n")  # v1's "unlimited"
    assert cgroup_room(tmp_path / "cg", proc) is None
    assert cgroup_room(tmp_path / "cg", tmp_path / "no such file") is None
