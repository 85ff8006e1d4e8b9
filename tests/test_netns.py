"""The network-namespace harness (tests/netns.py) itself: hosts reach each other and the etcd
through the bridge, a cut host is silently unreachable both ways, healing brings it back,
and nothing outlives the hosts."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from conftest import alive, processes_mentioning, wait_for
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


def test_leaving_kills_every_process_and_removes_the_network(tmp_path):
    marker = {**os.environ, "UNBROKEN_TEST_MARKER": str(tmp_path)}
    with Hosts() as hosts:
        leader = hosts.popen(0, ["sleep", "600"], env=marker)
        # A process in a session of its own escapes its parent's group, not its namespace.
        hosts.popen(1, ["sh", "-c", "setsid sleep 600 & wait"], env=marker)
        wait_for(lambda: len(processes_mentioning(str(tmp_path))) >= 3, 10, "the sleepers")
    assert leader.poll() is not None
    assert not [p for p in processes_mentioning(str(tmp_path)) if alive(p)]
    assert not Path(f"/sys/class/net/{hosts.bridge}").exists()
    assert not any(Path(f"/run/netns/{hosts.namespace(i)}").exists() for i in range(3))
