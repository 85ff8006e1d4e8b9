"""The etcd backend's security settings, checked before any request: what is refused and
the one line it says. (A real etcd with TLS and users: tests/integration/test_etcd_security.py.)
"""

from __future__ import annotations

import pytest

from unbroken.control.backend import StoreUnavailable
from unbroken.control.etcd import EtcdBackend


def test_an_unreadable_tls_file_is_one_line_at_construction(tmp_path):
    with pytest.raises(StoreUnavailable, match=r"^cannot load etcd's CA from --etcd-cacert "
                       r".*nope\.pem: No such file or directory$"):
        EtcdBackend(["127.0.0.1:1"], "r", cacert=str(tmp_path / "nope.pem"))
