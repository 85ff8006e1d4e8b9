"""The network-namespace harness (tests/netns.py) itself: hosts reach each other and the etcd
through the bridge, a cut host is silently unreachable both ways, healing brings it back,
each host resolves the others' names and names added while it runs, a host sees only its own
disk and the shared dirs it names, and nothing outlives the hosts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import alive, finish, processes_mentioning, wait_for
from netns import Hosts, unavailable

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))

PORT = 5000  # any port is free in a fresh namespace

# On a host: answer every connection with the address it came from.
SERVE = """
import socket, sys
server = socket.create_server((sys.argv[1], int(sys.argv[2])))
while True:
    conn, (peer, _) = server.accept()
    conn.sendall(peer.encode())
    conn.close()
"""
FETCH = """
import socket, sys
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2) as conn:
    print(conn.recv(100).decode())
"""
# On a host: read a key through etcd's v3 JSON gateway; prints the HTTP status.
READ_ETCD = """
import sys, urllib.request
request = urllib.request.Request(f"http://{sys.argv[1]}/v3/kv/range", data=b'{"key": "Zm9v"}')
with urllib.request.urlopen(request, timeout=2) as response:
    print(response.status)
"""

# On a host: each argument is read:PATH, write:PATH (writes "written") or list:PATH; prints
# one line for each: what it found ("wrote" for a write) or the error's errno name.
PROBE = """
import errno, os, sys
for op in sys.argv[1:]:
    kind, path = op.split(":", 1)
    try:
        if kind == "read":
            print(open(path).read())
        elif kind == "write":
            open(path, "w").write("written")
            print("wrote")
        else:
            print(",".join(sorted(os.listdir(path))))
    except OSError as e:
        print(errno.errorcode[e.errno])
"""
# On a host: the address each name resolves to, or "unresolved".
RESOLVE = """
import socket, sys
for name in sys.argv[1:]:
    try:
        print(socket.getaddrinfo(name, None, socket.AF_INET)[0][4][0])
    except socket.gaierror:
        print("unresolved")
"""
# On a host: say "unresolved" at once, then poll (up to 10 s) until the name resolves.
AWAIT_NAME = """
import socket, sys, time
print("unresolved", flush=True)
deadline = time.monotonic() + 10
while time.monotonic() < deadline:
    try:
        print(socket.getaddrinfo(sys.argv[1], None, socket.AF_INET)[0][4][0])
        break
    except socket.gaierror:
        time.sleep(0.05)
"""


def python(code: str, *args: object) -> list[str]:
    return [sys.executable, "-I", "-c", code, *map(str, args)]


def reads_etcd(hosts: Hosts, i: int) -> bool:
    return hosts.run(i, python(READ_ETCD, hosts.etcd.endpoint), timeout=10).stdout == "200\n"


def test_a_host_reaches_another_by_its_address(netns_hosts):
    hosts = netns_hosts
    hosts.popen(1, python(SERVE, hosts.addr(1), PORT))
    seen = wait_for(lambda: hosts.run(0, python(FETCH, hosts.addr(1), PORT), timeout=10).stdout,
                    10, "the server on h1 to answer h0")
    assert seen == f"{hosts.addr(0)}\n"


def test_a_cut_host_times_out_both_ways_while_the_others_reach_etcd(netns_hosts):
    hosts = netns_hosts
    etcd_host, etcd_port = hosts.etcd.endpoint.rsplit(":", 1)
    assert etcd_host == hosts.bridge_addr
    assert all(reads_etcd(hosts, i) for i in range(3))

    hosts.cut(0)
    assert hosts.connect(0, hosts.bridge_addr, int(etcd_port), timeout=2) == "timeout"
    assert hosts.connect(1, hosts.addr(0), PORT, timeout=2) == "timeout"  # not "refused"
    assert reads_etcd(hosts, 1) and reads_etcd(hosts, 2)

    hosts.heal(0)
    assert reads_etcd(hosts, 0)
    assert hosts.connect(1, hosts.addr(0), PORT, timeout=2) == "refused"


def probe(hosts: Hosts, i: int, *ops: str, shared=()) -> list[str]:
    result = hosts.run(i, python(PROBE, *ops), timeout=10, shared=shared)
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def test_a_host_sees_of_the_root_only_its_own_disk_and_the_shared_dirs_it_names(
        isolated_hosts, tmp_path):
    hosts = isolated_hosts
    ckpt = hosts.shared_dir("ckpt")
    (hosts.node_dir(0) / "mine").write_text("host 0's own")
    (tmp_path / "outside").write_text("not under the root")
    theirs = hosts.node_dir(1) / "theirs"
    assert probe(hosts, 1, f"write:{theirs}") == ["wrote"]
    assert theirs.exists()  # on host 1's disk, as seen from outside the hosts

    assert probe(hosts, 0, f"read:{theirs}", f"list:{hosts.node_dir(1)}",
                 f"read:{hosts.node_dir(0) / 'mine'}", f"read:{tmp_path / 'outside'}",
                 f"list:{hosts.root}", f"write:{hosts.root / 'stray'}",
                 f"write:{ckpt / 'step-5'}", shared=[ckpt]) == [
        "ENOENT", "ENOENT", "host 0's own", "not under the root", "host0,shared", "EROFS",
        "wrote"]
    assert probe(hosts, 1, f"read:{ckpt / 'step-5'}", shared=[ckpt]) == ["written"]
    assert probe(hosts, 2, f"read:{ckpt / 'step-5'}", f"list:{hosts.root}") == [
        "ENOENT", "host2"]
    assert not (hosts.root / "stray").exists()


def test_an_agent_runs_in_its_node_dir_and_its_output_is_read_by_finish(isolated_hosts):
    hosts = isolated_hosts
    code = ("import os; open('made-here', 'w').close(); "
            "print(os.getcwd(), os.environ['GLOO_SOCKET_IFNAME'], os.environ['EXTRA'])")
    proc = hosts.agent(1, python(code), env={"EXTRA": "yes"})
    result = finish(proc, hosts.node_dir(1), timeout=20)
    assert (result.code, result.output) == (0, f"{hosts.node_dir(1)} eth0 yes\n")
    assert (hosts.node_dir(1) / "made-here").exists()
    assert (hosts.node_dir(1) / "agent.out").exists()


def test_every_host_resolves_every_hosts_name(netns_hosts):
    hosts = netns_hosts
    names = [hosts.name(j) for j in range(3)]
    for i in range(3):
        result = hosts.run(i, python(RESOLVE, *names, "localhost"), timeout=10)
        assert result.stdout.split() == [*map(hosts.addr, range(3)), "127.0.0.1"], result


def test_a_name_added_to_a_host_resolves_there_in_processes_already_running(isolated_hosts):
    hosts = isolated_hosts
    waiter = hosts.popen(0, python(AWAIT_NAME, "store"), stdout=subprocess.PIPE, text=True)
    assert waiter.stdout.readline() == "unresolved\n"  # running, and it does not resolve yet
    hosts.add_name(0, "store", hosts.addr(2))
    out, _ = waiter.communicate(timeout=15)
    assert out == f"{hosts.addr(2)}\n"
    assert hosts.run(1, python(RESOLVE, "store"), timeout=10).stdout == "unresolved\n"


@pytest.mark.parametrize("isolated", [False, True], ids=["shared-disk", "isolated"])
def test_leaving_kills_every_process_and_removes_the_network(tmp_path, isolated):
    marker = {**os.environ, "UNBROKEN_TEST_MARKER": str(tmp_path)}
    root = tmp_path / "hosts" if isolated else None
    with Hosts(root) as hosts:
        leader = hosts.popen(0, ["sleep", "600"], env=marker)
        # A process in a session of its own escapes its parent's group, not its namespace.
        hosts.popen(1, ["sh", "-c", "setsid sleep 600 & wait"], env=marker)
        wait_for(lambda: len(processes_mentioning(str(tmp_path))) >= 3, 10, "the sleepers")
        assert all(Path(f"/etc/netns/{hosts.namespace(i)}/hosts").exists() for i in range(3))
        if isolated:  # the cover over the root is in the sleeper's mount namespace only
            wait_for(lambda: str(root) in Path(f"/proc/{leader.pid}/mountinfo").read_text(),
                     10, "the leader's mounts")
        assert str(tmp_path) not in Path("/proc/self/mountinfo").read_text()
    assert leader.poll() is not None
    assert not [p for p in processes_mentioning(str(tmp_path)) if alive(p)]
    assert not Path(f"/sys/class/net/{hosts.bridge}").exists()
    assert not any(Path(f"/run/netns/{hosts.namespace(i)}").exists() for i in range(3))
    assert not any(Path(f"/etc/netns/{hosts.namespace(i)}").exists() for i in range(3))
