"""Signing settled at first contact (`control.auth`), and how `unbroken drain` signs: pure
functions, no processes."""

from __future__ import annotations

from unbroken.control.address import ControlAddress, address_toward, unresolved


def test_endpoint_hosts_and_names_that_do_not_resolve():
    address = ControlAddress.parse("etcd://https://e1:2379,e2:2379,e1:2380")
    assert address.hosts == ["e1", "e2"]
    assert unresolved(["127.0.0.1", "localhost"]) == []
    assert unresolved(["no-such-host.invalid"]) == ["no-such-host.invalid"]
    assert address_toward("127.0.0.1:2379") == "127.0.0.1"
