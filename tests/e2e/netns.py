"""Two "hosts" on one machine: Linux network namespaces joined by a veth pair (needs root).

Each host is a network namespace with its own loopback and one end of the veth pair, addressed
from ``SUBNET`` (a /30 of the project's own choosing). A process started with ``exec_prefix`` runs
in that host's namespace; ``call_in`` runs a function on a thread that entered it (a network
namespace is per thread: the HTTP client of a test talks to the head node's loopback this way).

Traffic rule: nothing here, and nothing a test does through it, connects from the machine's own
namespace to a namespace address. This machine's own namespace routes any address it has no
route for to its default gateway (checked: a connect from there to a namespace address is
answered from outside the machine), so every connection to a host's address is made from inside
a namespace, where only loopback and the veth exist and there is no default route.

``TwoHosts`` is a context manager: the namespaces (and with them the veth pair) are removed on
exit, and ``leftovers()`` says whether anything of them remains.
"""

from __future__ import annotations

import ctypes
import functools
import os
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

NETNS_DIR = Path("/var/run/netns")
# A /30 of private address space: .1 is the head node, .2 the other host.
SUBNET = "10.213.32.{}"
PREFIX_LENGTH = 30
CLONE_NEWNET = 0x40000000
T = TypeVar("T")


@dataclass(frozen=True)
class Host:
    name: str  # "head" or "node1"
    namespace: str
    interface: str  # this host's end of the veth pair
    address: str


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@functools.cache
def namespace_refusal() -> str | None:
    """Why two hosts cannot be made here (not root, no ``ip``, no namespaces or veth); None if
    they can: a probe pair is made and removed, as ``TwoHosts`` would."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add); this test runs as a normal user"
    try:
        _ip("-V")
    except FileNotFoundError:
        return "the ip command (iproute2) is not installed"
    probe = TwoHosts(f"{os.getpid()}p")
    try:
        probe.create()
    except RuntimeError as exc:
        return f"two network namespaces and a veth pair cannot be made here: {exc}"
    finally:
        probe.remove()
    return None


class TwoHosts:
    """``head`` and ``node1``, each a network namespace, joined by one veth pair."""

    def __init__(self, tag: str | None = None) -> None:
        tag = tag or str(os.getpid())
        self.head = Host("head", f"vbal-{tag}-head", f"vb{tag}h", SUBNET.format(1))
        self.node1 = Host("node1", f"vbal-{tag}-node1", f"vb{tag}n", SUBNET.format(2))
        self.hosts = (self.head, self.node1)
        self._created: list[str] = []

    def __enter__(self) -> TwoHosts:
        remove_stale()
        try:
            self.create()
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.remove()

    def create(self) -> None:
        for host in self.hosts:
            self._run("netns", "add", host.namespace)
            self._created.append(host.namespace)
        self._run("link", "add", self.head.interface, "type", "veth", "peer", "name",
                  self.node1.interface)  # fmt: skip
        for host in self.hosts:
            self._run("link", "set", host.interface, "netns", host.namespace)
            inside = ("-n", host.namespace)
            self._run(*inside, "addr", "add", f"{host.address}/{PREFIX_LENGTH}", "dev",
                      host.interface)  # fmt: skip
            self._run(*inside, "link", "set", host.interface, "up")
            self._run(*inside, "link", "set", "lo", "up")

    def remove(self) -> None:
        """Delete the namespaces (the veth pair goes with them)."""
        for namespace in self._created:
            _ip("netns", "del", namespace)
        self._created = []

    def leftovers(self) -> list[str]:
        """Namespaces or interfaces of this pair still present (empty after ``remove()``)."""
        names = {host.namespace for host in self.hosts}
        left = sorted(n for n in names if (NETNS_DIR / n).exists())
        links = _ip("-o", "link", "show").stdout
        left += [h.interface for h in self.hosts if f" {h.interface}@" in links]
        return left

    @staticmethod
    def _run(*args: str) -> None:
        result = _ip(*args)
        if result.returncode != 0:
            raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")

    # ------------------------------------------------------------------ using the hosts
    @staticmethod
    def exec_prefix(host: Host) -> tuple[str, ...]:
        """Command prefix that runs a program in ``host``'s namespace (it execs: same PID)."""
        return ("ip", "netns", "exec", host.namespace)

    @staticmethod
    def call_in(host: Host, function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``function(*args, **kwargs)`` on a thread inside ``host``'s network namespace."""
        outcome: dict[str, Any] = {}

        def run() -> None:
            try:
                enter_namespace(host.namespace)
                outcome["value"] = function(*args, **kwargs)
            except BaseException as exc:  # handed to the caller
                outcome["error"] = exc

        thread = threading.Thread(target=run, name=f"in-{host.name}", daemon=True)
        thread.start()
        thread.join()
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]


def remove_stale() -> list[str]:
    """Remove the namespaces of earlier runs whose test process is gone (killed mid-run before
    its own tear-down); returns their names. Only this module's names: ``vbal-<pid>-...``."""
    removed = []
    for path in NETNS_DIR.glob("vbal-*-*") if NETNS_DIR.is_dir() else ():
        pid = path.name.split("-")[1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            _ip("netns", "del", path.name)
            removed.append(path.name)
    return removed


def enter_namespace(namespace: str) -> None:
    """Move the calling thread into ``namespace`` (its sockets are made there from now on)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(NETNS_DIR / namespace, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns({namespace})")
    finally:
        os.close(fd)


def tcp_peers(pid: int) -> set[str]:
    """Remote IPv4 addresses of the established TCP connections process ``pid`` holds.

    ``/proc/<pid>/net/tcp`` lists the sockets of the process's network namespace; only those
    whose inode is one of the process's own file descriptors count.
    """
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    peers = set()
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        remote, state, inode = fields[2], fields[3], fields[9]
        if state == "01" and inode in inodes:  # 01: ESTABLISHED
            peers.add(_ipv4(remote.split(":")[0]))
    return peers


def _ipv4(little_endian_hex: str) -> str:
    """``/proc/net/tcp``'s address (hex, host byte order on x86) as dotted quad."""
    return ".".join(str(b) for b in int(little_endian_hex, 16).to_bytes(4, "little"))
