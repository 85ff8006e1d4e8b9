"""Three "hosts" on one machine, for end-to-end tests that need a network that can fail and
nodes that share nothing.

`Hosts` builds a bridge in the root network namespace and three namespaces on it, each
joined by a veth pair; it can cut a host's link and heal it. Agents run inside a host with
`hosts.popen(i, argv)` (`ip netns exec`); the control store (etcd, see the `netns_hosts` and
`isolated_hosts` fixtures in conftest.py) runs in the root namespace on the bridge address.

The contract:
- Host i is namespace `ub<tag>-h<i>` with address 10.x.y.(11+i)/24 on its `eth0`; the root
  side of the bridge is 10.x.y.1 (`bridge_addr`). The subnet is free on this machine, and
  the tag names it, so that concurrent instances never clash.
- Names: host i has a hosts file of its own (/etc/netns/<ns>/hosts, which `ip netns exec`
  binds over /etc/hosts): localhost, this machine's hostname (127.0.0.1, as outside), and
  every host's `name(j)` ("host<j>") for `addr(j)`. `add_name(i, name, addr)` appends to it
  in place, so host i's processes, already running ones included, resolve the name at once.
- Disks, with `Hosts(root)`: host i's disk is `node_dir(i)` (root/host<i>) and a volume that
  hosts may share is `shared_dir(name)` (root/shared/<name>). A command started on host i
  (`popen`, `run`, `agent`) sees, under root, only node_dir(i) and the shared dirs it lists
  in `shared`, at their own paths; the rest of root is an empty read-only tmpfs, so a read
  of another node's file fails (FileNotFoundError) and a write outside those dirs fails
  (EROFS). Outside root nothing changes. Without root, nothing is hidden. With root, a
  command on host i also has a hostname of its own, `name(i)`, as a pod has.
- `cut(i)` drops every packet to and from host i silently: no reset, no ICMP, no ARP
  failure (neighbours are pinned), so a connect times out and an open connection just
  stops hearing back. `heal(i)` restores the link and waits (at most 10 s) until it
  carries traffic again.
- On exit, even a failed one, every process in the namespaces is killed, whoever started
  it, and the namespaces, veths, bridge and hosts files are removed. The mounts that hide
  root live only in each command's own mount namespace (slave to the root one): they go
  with its processes and are never seen outside it.
- Every wait is bounded. Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN) and iproute2: see
  `unavailable()`.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterable
from contextlib import suppress
from ipaddress import IPv4Network, ip_network
from pathlib import Path

from conftest import wait_for

HOSTS = 3
_CAP_NET_ADMIN, _CAP_SYS_ADMIN = 12, 21
_instances = itertools.count()

# Run inside a host: how a TCP connect ends (refused also proves the path works).
_CONNECT = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close()
    print("connected")
except TimeoutError:
    print("timeout")
except ConnectionRefusedError:
    print("refused")
except OSError as e:
    print(f"error: {e}")
"""


# Run by `ip netns exec`, in the command's own mount namespace (already a slave of the root
# one, so nothing done here is seen outside): take a UTS namespace named NAME (a pod's
# hostname, which torchrun's c10d rendezvous matches against its endpoint), cover ROOT with
# an empty tmpfs, bind each SRC at its DST (DST made if missing: inside ROOT in the tmpfs,
# outside it as an empty dir on this machine; `:ro` binds it read-only), make the cover
# read-only, chdir to CWD, exec ARGV. argv: NAME ROOT CWD SRC=DST[:ro]... -- ARGV... The
# sources are opened before ROOT is covered and bound from /proc/self/fd, so no staging dir is
# needed anywhere. Shared with tests/pods.py, whose pods bind their volumes this way.
ISOLATE = """
import ctypes, os, sys
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC = 1, 2, 4, 32, 4096, 16384
libc = ctypes.CDLL(None, use_errno=True)
def mount(source, target, fstype, flags, data):
    if libc.mount(source.encode(), target.encode(), fstype.encode(), flags, data.encode()):
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target}: {os.strerror(err)}")
split = sys.argv.index("--")
name, root, cwd = sys.argv[1].encode(), sys.argv[2], sys.argv[3]
binds, argv = sys.argv[4:split], sys.argv[split + 1:]
if libc.unshare(0x04000000) or libc.sethostname(name, len(name)):  # CLONE_NEWUTS
    raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWUTS) or sethostname")
opened = []
for spec in binds:
    src, dst = spec.split("=", 1)
    ro = dst.endswith(":ro")
    dst = dst[:-3] if ro else dst
    if not (dst + "/").startswith(root.rstrip("/") + "/"):
        os.makedirs(dst, exist_ok=True)
    opened.append((os.open(src, os.O_PATH | os.O_DIRECTORY), dst, ro))
mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755")
for fd, dst, ro in opened:
    os.makedirs(dst, exist_ok=True)
    mount(f"/proc/self/fd/{fd}", dst, "", MS_BIND | MS_REC, "")
    if ro:
        mount("", dst, "", MS_REMOUNT | MS_BIND | MS_RDONLY | MS_REC, "")
    os.close(fd)
mount("", root, "", MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV, "")
os.chdir(cwd)
os.execvpe(argv[0], argv, os.environ)
"""


def unavailable() -> str | None:
    """Why this machine cannot build `Hosts`; None when it can."""
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    caps = int(re.search(r"CapEff:\s*(\w+)", Path("/proc/self/status").read_text())[1], 16)
    if not caps >> _CAP_NET_ADMIN & 1 or not caps >> _CAP_SYS_ADMIN & 1:
        return "root here lacks CAP_NET_ADMIN or CAP_SYS_ADMIN (an unprivileged container?)"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)
    if check and result.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")
    return result


def _networks_in_use() -> list[IPv4Network]:
    routes = _ip("-4", "route", "show", "table", "all").stdout.splitlines()
    prefixes = (line.split()[0] for line in routes if line and line[0].isdigit())
    return [ip_network(p, strict=False) for p in prefixes]


def _claim_bridge() -> int:
    """Create the bridge of a free subnet 10.x.y.0/24 and return n = x*256 + y. The
    bridge's name encodes n, so its creation claims the subnet against other instances."""
    in_use = _networks_in_use()
    first = os.getpid() * 16 + next(_instances)
    for k in range(256):
        n = 0x100 + (first + k) % 0xFE00  # x in 1..254
        net = ip_network(f"10.{n >> 8}.{n & 0xFF}.0/24")
        if any(net.overlaps(other) for other in in_use):
            continue
        result = _ip("link", "add", f"ubr{n:04x}", "type", "bridge", check=False)
        if not result.returncode:
            return n
        if "exists" not in result.stderr:
            raise RuntimeError(f"ip link add: {result.stderr.strip()}")
    raise RuntimeError("no free 10.x.y.0/24 subnet for a bridge")


class Hosts:
    """Three network namespaces on one bridge; a context manager (see the module doc).
    With `root`, each host's commands see only their own dir of it (and the shared dirs they
    name)."""

    def __init__(self, root: Path | None = None) -> None:
        self.procs: list[subprocess.Popen] = []
        self.etcd = None  # set by the `netns_hosts` and `isolated_hosts` fixtures
        self.root = None if root is None else Path(root).resolve()
        self._n: int | None = None

    # ------------------------------------------------------------ names and addresses
    @property
    def tag(self) -> str:
        return f"{self._n:04x}"

    @property
    def bridge(self) -> str:
        return f"ubr{self.tag}"

    def namespace(self, i: int) -> str:
        return f"ub{self.tag}-h{i}"

    def _veth(self, i: int) -> str:
        """The root-side end of host i's veth pair (the bridge port)."""
        return f"ub{self.tag}h{i}"

    def _on_subnet(self, last: int) -> str:
        return f"10.{self._n >> 8}.{self._n & 0xFF}.{last}"

    def addr(self, i: int) -> str:
        return self._on_subnet(11 + i)

    @property
    def bridge_addr(self) -> str:
        return self._on_subnet(1)

    def name(self, i: int) -> str:
        """Host i's name; it resolves to addr(i) on every host."""
        return f"host{i}"

    def _hosts_file(self, i: int) -> Path:
        """Host i's /etc/hosts (`ip netns exec` binds /etc/netns/<ns>/* over /etc/*)."""
        return Path("/etc/netns", self.namespace(i), "hosts")

    def add_name(self, i: int, name: str, addr: str) -> None:
        """Make `name` resolve to `addr` on host i, for processes already running there too.
        Appends in place: the bind mount over their /etc/hosts holds this very inode."""
        with open(self._hosts_file(i), "a") as f:
            f.write(f"{addr} {name}\n")

    # ------------------------------------------------------------ disks
    def _under_root(self, *parts: str) -> Path:
        if self.root is None:
            raise ValueError("these Hosts have no root: build them with Hosts(root)")
        path = self.root.joinpath(*parts)
        path.mkdir(parents=True, exist_ok=True)
        return path

    def node_dir(self, i: int) -> Path:
        """Host i's own disk, root/host<i> (created): the only dir of root it sees."""
        return self._under_root(f"host{i}")

    def shared_dir(self, name: str) -> Path:
        """root/shared/<name> (created): seen by a command whose `shared` lists it."""
        if not name or "/" in name or name in (".", ".."):
            raise ValueError(f"a shared dir's name is one path component, not {name!r}")
        return self._under_root("shared", name)

    def _mac(self, addr: str) -> str:
        """A fixed MAC for an address of the subnet, so that neighbours can be pinned."""
        return "02:00:" + ":".join(f"{int(b):02x}" for b in addr.split(".")[1:]) + ":00"

    # ------------------------------------------------------------ building and removing
    def __enter__(self) -> Hosts:
        self._n = _claim_bridge()
        try:
            self._build()
        except BaseException:
            self._remove()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._remove()

    def _build(self) -> None:
        _ip("link", "set", self.bridge, "address", self._mac(self.bridge_addr), "up")
        _ip("addr", "add", f"{self.bridge_addr}/24", "dev", self.bridge)
        for i in range(HOSTS):
            self._add_host(i)
        self._pin_neighbours()
        self._write_hosts_files()
        if self.root is not None:
            self.root.mkdir(parents=True, exist_ok=True)

    def _write_hosts_files(self) -> None:
        lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback",
                 f"127.0.0.1 {socket.gethostname()}"]
        lines += [f"{self.addr(j)} {self.name(j)}" for j in range(HOSTS)]
        for i in range(HOSTS):
            for _ in range(3):  # another instance may remove an empty /etc/netns meanwhile
                with suppress(FileNotFoundError):
                    self._hosts_file(i).parent.mkdir(parents=True, exist_ok=True)
                    self._hosts_file(i).write_text("\n".join(lines) + "\n")
                    break
            else:
                raise RuntimeError(f"could not write {self._hosts_file(i)}")

    def _add_host(self, i: int) -> None:
        ns = self.namespace(i)
        _ip("netns", "add", ns)
        _ip("link", "add", self._veth(i), "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("link", "set", self._veth(i), "master", self.bridge, "up")
        _ip("-n", ns, "link", "set", "eth0", "address", self._mac(self.addr(i)), "up")
        _ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "lo", "up")

    def _pin_neighbours(self) -> None:
        """Permanent ARP entries everywhere: a cut host's peers then never learn that it is
        gone (an unresolved neighbour fails a connect with EHOSTUNREACH after ~3 s)."""
        everyone = [self.bridge_addr, *map(self.addr, range(HOSTS))]
        for i in range(HOSTS):
            _ip("neigh", "replace", self.addr(i), "lladdr", self._mac(self.addr(i)),
                "dev", self.bridge, "nud", "permanent")
            for peer in everyone:
                if peer != self.addr(i):
                    _ip("-n", self.namespace(i), "neigh", "replace", peer, "lladdr",
                        self._mac(peer), "dev", "eth0", "nud", "permanent")

    def _remove(self) -> None:
        try:
            self._kill_everything()
        finally:
            for i in range(HOSTS):
                _ip("link", "del", self._veth(i), check=False)
                _ip("netns", "del", self.namespace(i), check=False)
                shutil.rmtree(self._hosts_file(i).parent, ignore_errors=True)
            _ip("link", "del", self.bridge, check=False)
            with suppress(OSError):  # only when empty: other instances may still use it
                os.rmdir("/etc/netns")

    def _kill_everything(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:  # its group id is still held: no stranger can have it
                with suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
        wait_for(lambda: not self._kill_stragglers(), 10, "the hosts' processes to die")
        for proc in self.procs:
            proc.wait(timeout=10)

    def _kill_stragglers(self) -> list[int]:
        """SIGKILL every process still in a host's namespace (a session of its own included);
        the pids found."""
        pids = [int(p) for i in range(HOSTS)
                for p in _ip("netns", "pids", self.namespace(i), check=False).stdout.split()]
        for pid in pids:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return pids

    # ------------------------------------------------------------ running and failing
    def _command(self, i: int, argv: list[str], shared: Iterable[Path | str],
                 cwd: Path | str | None) -> list[str]:
        """argv run on host i: in its network namespace and, with a root, behind the cover
        that leaves it only node_dir(i) and `shared` of root. The cwd is entered after
        the mounts (by path: the caller's own, when none is given)."""
        shared = [Path(path).resolve() for path in shared]
        if self.root is None:
            if shared:
                raise ValueError("shared dirs need Hosts(root)")
            return ["ip", "netns", "exec", self.namespace(i), *argv]
        for path in shared:
            if path.parent != self.root / "shared" or not path.is_dir():
                raise ValueError(f"{path} is not a shared_dir() of these hosts")
        keep = [str(self.node_dir(i)), *map(str, dict.fromkeys(shared))]
        cwd = os.path.abspath(os.getcwd() if cwd is None else cwd)
        return ["ip", "netns", "exec", self.namespace(i), sys.executable, "-I", "-c", ISOLATE,
                self.name(i), str(self.root), cwd, *[f"{k}={k}" for k in keep], "--", *argv]

    def popen(self, i: int, argv: list[str], *, shared: Iterable[Path | str] = (),
              **popen_kwargs) -> subprocess.Popen:
        """Start argv on host i in a session of its own; killed, with its tree, on exit.
        With a root it sees only node_dir(i) and the `shared` dirs of it."""
        cwd = popen_kwargs.pop("cwd", None) if self.root is not None else None  # see _command
        proc = subprocess.Popen(self._command(i, argv, shared, cwd), start_new_session=True,
                                **popen_kwargs)
        self.procs.append(proc)
        return proc

    def run(self, i: int, argv: list[str], timeout: float, *,
            shared: Iterable[Path | str] = ()) -> subprocess.CompletedProcess:
        """Run argv on host i to completion (killed at timeout); its output as text."""
        return subprocess.run(self._command(i, argv, shared, None),
                              capture_output=True, text=True, timeout=timeout)

    def agent(self, i: int, argv: list[str], *, shared: Iterable[Path | str] = (),
              env: dict[str, str] | None = None, output: str = "agent.out") -> subprocess.Popen:
        """popen argv on host i in node_dir(i), its output (both streams) in
        node_dir(i)/`output`, kept open as `proc.output_file` for conftest's `finish`;
        GLOO_SOCKET_IFNAME=eth0 (each host's own address, for gloo) and `env` added to
        this process's environment."""
        out = open(self.node_dir(i) / output, "w+b")  # noqa: SIM115 - closed by finish()
        try:
            proc = self.popen(i, argv, shared=shared, stdout=out, stderr=subprocess.STDOUT,
                              cwd=self.node_dir(i),
                              env={**os.environ, "GLOO_SOCKET_IFNAME": "eth0", **(env or {})})
        except BaseException:
            out.close()
            raise
        proc.output_file = out  # type: ignore[attr-defined]
        return proc

    def connect(self, i: int, host: str, port: int, timeout: float) -> str:
        """How a TCP connect from host i ends: "connected", "refused", "timeout" or
        "error: ..."."""
        argv = [sys.executable, "-I", "-c", _CONNECT, host, str(port), str(timeout)]
        return self.run(i, argv, timeout + 10).stdout.strip()

    def cut(self, i: int) -> None:
        """Drop every packet to and from host i, silently, until heal(i)."""
        _ip("link", "set", self._veth(i), "down")

    def heal(self, i: int) -> None:
        """Give host i its link back; returns once it reaches the bridge address again."""
        _ip("link", "set", self._veth(i), "master", self.bridge, "up")
        wait_for(lambda: self.connect(i, self.bridge_addr, 9, 0.5) in ("connected", "refused"),
                 10, f"host {i} to reach {self.bridge_addr} again")
