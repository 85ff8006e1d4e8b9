"""The etcd backend against a real etcd with TLS (client certificates required) and with user
authentication: the protocol works through both, every wrong setting is one line that says
what to fix (and never shows a secret), and the two bulk calls (`get_many`, `delete_prefix`)
do what the agents rely on."""

from __future__ import annotations

import contextlib
import json
import shutil
import ssl
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import free_port, wait_for

from unbroken.control.backend import StoreUnavailable
from unbroken.control.etcd import EtcdBackend

PASSWORD = "s3cret-Pa55"


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=30)


def _issue(d: Path, name: str, ca: str, extensions: str) -> None:
    """`name`.pem/.key: an EC certificate signed by the CA `ca`.pem/.key."""
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", str(d / f"{name}.key"), "-out", str(d / f"{name}.csr"), "-subj", f"/CN={name}")
    (d / f"{name}.ext").write_text(extensions)
    _openssl("x509", "-req", "-in", str(d / f"{name}.csr"), "-CA", str(d / f"{ca}.pem"),
             "-CAkey", str(d / f"{ca}.key"), "-CAcreateserial", "-days", "1",
             "-extfile", str(d / f"{name}.ext"), "-out", str(d / f"{name}.pem"))


def make_pki(d: Path) -> Path:
    """A throwaway CA (`ca`) with a server certificate for 127.0.0.1 (`server`) and a client
    certificate (`client`); another CA (`other`) that signed a client certificate (`stranger`)."""
    for ca in ("ca", "other"):
        _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                 "-nodes", "-keyout", str(d / f"{ca}.key"), "-out", str(d / f"{ca}.pem"),
                 "-days", "1", "-subj", f"/CN={ca}")
    # clientAuth too: etcd's gateway presents its server certificate to its own gRPC server
    _issue(d, "server", "ca", "subjectAltName=IP:127.0.0.1\n"
                              "extendedKeyUsage=serverAuth,clientAuth\n")
    _issue(d, "client", "ca", "extendedKeyUsage=clientAuth\n")
    _issue(d, "stranger", "other", "extendedKeyUsage=clientAuth\n")
    return d


@contextlib.contextmanager
def serve_etcd(data: Path, scheme: str = "http", *flags: str,
               context: ssl.SSLContext | None = None) -> Iterator[str]:
    """A one-member etcd on loopback, its client URL `scheme`://127.0.0.1:PORT (`flags` added,
    `context` to check its health over TLS); killed when the block ends."""
    binary = shutil.which("etcd")
    assert binary, "etcd is not installed: run `make install` or `apt-get install etcd-server`"
    client, peer = free_port(), free_port()
    url = f"{scheme}://127.0.0.1:{client}"
    proc = subprocess.Popen(
        [binary, "--name", "t", "--data-dir", str(data), "--listen-client-urls", url,
         "--advertise-client-urls", url, "--listen-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-cluster", f"t=http://127.0.0.1:{peer}", "--log-level", "error", *flags],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)

    def healthy() -> bool:
        assert proc.poll() is None, f"etcd exited with {proc.returncode}"
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1, context=context) as r:
                return b"true" in r.read()
        except OSError:
            return False

    try:
        wait_for(healthy, 30, "etcd to serve")
        yield url
    finally:
        proc.kill()
        proc.wait(timeout=10)


def gateway(url: str, path: str, body: dict, token: str | None = None) -> dict:
    headers = {"Authorization": token} if token else {}
    request = urllib.request.Request(f"{url}/v3/{path}", json.dumps(body).encode(), headers)
    with urllib.request.urlopen(request, timeout=5) as response:
        return json.loads(response.read())


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    """(https URL of an etcd that requires client certificates, the PKI directory)."""
    pki = make_pki(tmp_path_factory.mktemp("pki"))
    check = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    check.load_cert_chain(str(pki / "client.pem"), str(pki / "client.key"))
    flags = ["--cert-file", str(pki / "server.pem"), "--key-file", str(pki / "server.key"),
             "--trusted-ca-file", str(pki / "ca.pem"), "--client-cert-auth"]
    with serve_etcd(tmp_path_factory.mktemp("etcd-tls"), "https", *flags, context=check) as url:
        yield url, pki


@pytest.fixture(scope="module")
def auth(tmp_path_factory):
    """The http URL of an etcd with authentication on: user root (PASSWORD), and user alice
    (PASSWORD) with no role."""
    with serve_etcd(tmp_path_factory.mktemp("etcd-auth")) as url:
        for name in ("root", "alice"):
            gateway(url, "auth/user/add", {"name": name, "password": PASSWORD})
        gateway(url, "auth/role/add", {"name": "root"})  # etcd 3.4 enables auth only once
        gateway(url, "auth/user/grant", {"user": "root", "role": "root"})  # root has it
        gateway(url, "auth/enable", {})
        yield url


def one_line_error(backend: EtcdBackend) -> str:
    with pytest.raises(StoreUnavailable) as caught:
        backend.get("current")
    text = str(caught.value)
    assert "\n" not in text and caught.value.__cause__ is None, text
    return text


def exercise(backend: EtcdBackend) -> None:
    backend.set("a", "1")
    assert backend.get("a") == "1" and backend.get("missing") is None
    assert backend.compare_set("a", "1", "2") == "2"
    assert backend.compare_set("a", "1", "3") == "2"  # lost: it holds "2"
    assert backend.compare_set("new", None, "x") == "x"
    assert backend.add("n", 5) == 5 and backend.add("n", 2) == 7


# ------------------------------------------------------------------ TLS
def test_the_protocol_works_over_tls_with_a_client_certificate(tls):
    url, pki = tls
    bare = url.removeprefix("https://")  # a CA given: a bare HOST:PORT is https, as etcdctl
    backend = EtcdBackend([bare], "tls", cacert=str(pki / "ca.pem"),
                          cert=str(pki / "client.pem"), key=str(pki / "client.key"))
    assert backend.endpoints == [url]
    exercise(backend)
    store = backend.rendezvous_store("g/1/pg/", 5)
    store.set("k", b"\xff")  # c10d values are bytes, not text
    assert store.get("k") == b"\xff"


def test_plain_http_against_a_tls_etcd_says_to_use_https(tls):
    url, _ = tls
    http = url.replace("https://", "http://")
    assert one_line_error(EtcdBackend([http], "r", timeout=2)) == (
        f"etcd at {http} expects TLS: use an https:// endpoint")


def _client(url: str, pki, ca: str = "ca", who: str = "client") -> EtcdBackend:
    """A backend that trusts `ca` and presents `who`'s certificate (files made by `tls`)."""
    return EtcdBackend([url], "r", cacert=str(pki / f"{ca}.pem"), cert=str(pki / f"{who}.pem"),
                       key=str(pki / f"{who}.key"))


def test_a_certificate_from_an_unknown_ca_says_to_pass_the_right_one(tls):
    url, pki = tls
    backend = _client(url, pki, ca="other")
    assert one_line_error(backend) == (
        f"TLS handshake with etcd at {url}: certificate verify failed (unknown CA); pass the "
        "CA that signed etcd's certificate with --etcd-cacert")


def test_a_host_name_the_certificate_does_not_list_is_named(tls):
    url, pki = tls
    by_name = url.replace("127.0.0.1", "localhost")
    backend = _client(by_name, pki)
    assert "certificate verify failed (it is not valid for 'localhost'); use a host name or " \
           "IP address that etcd's certificate lists" in one_line_error(backend)


def test_a_missing_client_certificate_says_which_flags_to_pass(tls):
    url, pki = tls
    backend = EtcdBackend([url], "r", cacert=str(pki / "ca.pem"))
    assert one_line_error(backend) == (
        f"etcd at {url} requires a client certificate (it runs with --client-cert-auth): pass "
        "one with --etcd-cert and --etcd-key")


def test_a_client_certificate_etcd_does_not_trust_is_refused_in_one_line(tls):
    url, pki = tls
    backend = _client(url, pki, who="stranger")
    assert one_line_error(backend) == (
        f"etcd at {url} refused the client certificate {pki / 'stranger.pem'}: pass one signed "
        "by a CA in etcd's --trusted-ca-file")


def test_https_against_a_plain_etcd_says_to_use_http(auth, tmp_path):
    https = auth.replace("http://", "https://")
    assert one_line_error(EtcdBackend([https], "r", timeout=2)) == (
        f"etcd at {https} does not speak TLS: use an http:// endpoint")


# ------------------------------------------------------------------ users
def test_the_protocol_works_as_a_user_and_renews_a_forgotten_token(auth):
    backend = EtcdBackend([auth], "users", user="root", password=PASSWORD)
    exercise(backend)
    backend._gateway._token = "forgotten.1"  # what etcd answers for an expired token: HTTP 401
    assert backend.get("a") == "2" and backend._gateway._token != "forgotten.1"
    store = backend.rendezvous_store("g/1/pg/", 5)  # logs in on its own
    store.set("k", b"v")
    assert store.get("k") == b"v"


def test_a_wrong_password_is_one_line_without_the_password(auth):
    text = one_line_error(EtcdBackend([auth], "r", user="root", password="not-" + PASSWORD))
    assert text == (f"etcd at {auth} refused user 'root': authentication failed; check "
                    "--etcd-user and the password in UNBROKEN_ETCD_PASSWORD")
    assert PASSWORD not in text


def test_no_user_against_an_etcd_with_auth_says_a_user_is_needed(auth):
    assert one_line_error(EtcdBackend([auth], "r")) == (
        f"etcd at {auth} has authentication enabled: pass a user with --etcd-user and its "
        "password in UNBROKEN_ETCD_PASSWORD")
    assert one_line_error(EtcdBackend([auth], "r", user="root")) == (
        "no password for etcd user 'root': set UNBROKEN_ETCD_PASSWORD")


def test_a_user_without_permission_is_told_what_to_grant_and_no_secret_leaks(auth):
    backend = EtcdBackend([auth], "r", user="alice", password=PASSWORD)
    text = one_line_error(backend)
    assert text == (f"etcd at {auth} denied user 'alice' kv/txn: grant it a role with "
                    "readwrite permission on the keys under 'unbroken/'")
    assert backend._gateway._token and backend._gateway._token not in text and PASSWORD not in text


# ------------------------------------------------------------------ bulk calls
def test_delete_prefix_removes_only_this_runs_keys(auth):
    mine = EtcdBackend([auth], "job", user="root", password=PASSWORD)
    other = EtcdBackend([auth], "job2", user="root", password=PASSWORD)  # 'job' is its prefix
    mine.set("current", "1")
    mine.add("a/0/news", 3)
    store = mine.rendezvous_store("g/1/pg/", 5)
    store.set("rank0", b"addr")
    other.set("current", "7")
    mine.delete_prefix()
    assert mine.get_many(["current", "a/0/news"]) == [None, None]
    assert not store.check(["rank0"])
    assert other.get("current") == "7"


def test_get_many_reads_hundreds_of_keys_in_order(auth):
    backend = EtcdBackend([auth], "many", user="root", password=PASSWORD)
    keys = [f"lease/{i}" for i in range(300)]
    for i in range(0, 300, 3):  # every third key is set: the rest are missing
        backend.set(keys[i], str(i))
    assert backend.get_many(keys) == [str(i) if i % 3 == 0 else None for i in range(300)]
    assert backend.get_many([]) == []
