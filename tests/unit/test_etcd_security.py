"""The etcd backend against a real etcd with TLS (client certificates required) and with user
authentication: the protocol works through both, every wrong setting is one line that says
what to fix (and never shows a secret), and the two bulk calls (`get_many`, `delete_prefix`)
do what the agents rely on."""

from __future__ import annotations

import pytest

from unbroken.control.backend import StoreUnavailable
from unbroken.control.etcd import EtcdBackend


def test_an_unreadable_tls_file_is_one_line_at_construction(tmp_path):
    with pytest.raises(StoreUnavailable, match=r"^cannot load etcd's CA from --etcd-cacert "
                       r".*nope\.pem: No such file or directory$"):
        EtcdBackend(["127.0.0.1:1"], "r", cacert=str(tmp_path / "nope.pem"))
