"""The network lab: separate "hosts" for real ``peerd`` processes, built from network namespaces.

One ``Lab`` is one private network for one test::

    hub namespace:   bridge ``br0`` (the "internet", 10.211.0.0/24)
    host namespace:  ``eth0`` (veth into br0), 10.211.0.N, both ends shaped by tbf
    NAT router:      ``wan`` (veth into br0, 10.211.0.N) and ``lan`` (veth to one private host,
                     10.211.M.1/24 <-> 10.211.M.2); nftables masquerade on ``wan``

Nothing is created in the root namespace: every interface is made inside, or moved straight into,
a namespace of the lab, and deleting the namespaces removes it all again. Namespace names start
with ``pdlab-<pid>-``, so a later run can tell (by the pid) which leftovers of an interrupted run
it may remove.

The test process itself stays in the root namespace. It reads a peer's ``/status`` endpoint (which
listens on 127.0.0.1 inside the peer's namespace) through a socket made by a short-lived thread
that switched into that namespace: a network namespace belongs to a thread, not to the process, and
a socket stays in the namespace it was made in.

``netem`` is not available in the kernel this lab was built for, so links have a rate (tbf) but
no added delay or loss; a test that needs delay adds it at the application edge.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Lab", "LabHost", "LabPeer", "lab_unavailable", "remove_leftovers", "PEER_PORT", "STATUS_PORT"]

PREFIX = "pdlab-"
NETNS_DIR = Path("/run/netns")
SUBNET = "10.211"  # a private range used only inside the lab's namespaces
PEER_PORT = 31337  # every host has its own port space, so all peers can listen on peerd's default
STATUS_PORT = 8080
# tbf needs a bucket of at least rate/HZ; 256 kB holds ~20 ms at 100 Mbit/s, and a 50 ms queue
# limit keeps the added queueing delay of a saturated link near a real access link's.
TBF_BURST = "256kb"
TBF_LATENCY = "50ms"
CLONE_NEWNET = 0x40000000
STOP_GRACE = 5.0  # for every peer of a lab together, after SIGTERM
START_TIMEOUT = 90.0  # importing torch and building the task in 5 processes on 2 busy cores
PEERD = [sys.executable, "-m", "peerd.cli"]
REPO = Path(__file__).resolve().parents[2]

_libc = ctypes.CDLL(None, use_errno=True)


def lab_unavailable(nat: bool = False) -> str | None:
    """Why the lab cannot run here (a reason naming what is missing), or None when it can."""
    if sys.platform != "linux":
        return "the network lab needs Linux network namespaces"
    if os.geteuid() != 0:
        return "the network lab needs root (ip netns, veth, tc)"
    tools = ["ip", "tc", "nft"] if nat else ["ip", "tc"]
    missing = [tool for tool in tools if shutil.which(tool) is None]
    if missing:
        return f"the network lab needs {', '.join(missing)} (apt-get install {_packages(missing)})"
    probe = f"{PREFIX}{os.getpid()}-probe"
    result = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if result.returncode != 0:
        return f"cannot create a network namespace: {result.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _packages(tools: list[str]) -> str:
    return " ".join(sorted({"nftables" if tool == "nft" else "iproute2" for tool in tools}))


def _run(*args: str, input: str | None = None) -> None:
    result = subprocess.run(args, capture_output=True, text=True, input=input)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}")


def _in(namespace: str, *args: str, input: str | None = None) -> None:
    _run("ip", "netns", "exec", namespace, *args, input=input)


def _delete_namespace(name: str) -> None:
    """Kill whatever still runs inside, then delete the namespace (its interfaces go with it)."""
    pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    subprocess.run(["ip", "netns", "del", name], capture_output=True)


def remove_leftovers() -> list[str]:
    """Delete namespaces of lab runs whose process is gone (an interrupted run); returns their names."""
    removed = []
    names = sorted(path.name for path in NETNS_DIR.glob(f"{PREFIX}*")) if NETNS_DIR.is_dir() else []
    for name in names:
        pid = name.removeprefix(PREFIX).split("-", 1)[0]
        if pid.isdigit() and Path(f"/proc/{pid}").exists():
            continue  # this run's, or another live run's
        _delete_namespace(name)
        removed.append(name)
    return removed


def connect_in(namespace: str, host: str, port: int, timeout: float) -> Any:
    """A TCP socket connected from inside ``namespace`` (the calling thread never changes namespace)."""
    import socket

    outcome: dict[str, Any] = {}

    def connect() -> None:
        try:
            with open(NETNS_DIR / namespace) as target:
                if _libc.setns(target.fileno(), CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns into {namespace} failed")
            # this thread now lives in the lab's namespace and ends right after; the test's
            # own threads never leave the root namespace
            outcome["socket"] = socket.create_connection((host, port), timeout=timeout)
        except OSError as error:
            outcome["error"] = error

    thread = threading.Thread(target=connect, name=f"netlab-connect-{namespace}", daemon=True)
    thread.start()
    thread.join(timeout + 5)
    if "socket" in outcome:
        return outcome["socket"]
    raise outcome.get("error") or TimeoutError(f"no connection in {namespace} within {timeout} s")


@dataclass
class LabHost:
    """One namespace with one address: a public host, or a private host behind a NAT router."""

    lab: Lab
    name: str
    namespace: str
    address: str
    hub_port: str | None  # the veth end in the hub (None behind NAT: its router's port is cut)
    rate_mbit: float | None
    router: LabHost | None = None

    def exec(self, *args: str) -> None:
        _in(self.namespace, *args)

    def cut(self) -> None:
        """Partition: this host (or its NAT router) loses its link to the hub."""
        port = self.hub_port or (self.router.hub_port if self.router else None)
        _run("ip", "-n", self.lab.hub, "link", "set", port, "down")

    def heal(self) -> None:
        port = self.hub_port or (self.router.hub_port if self.router else None)
        _run("ip", "-n", self.lab.hub, "link", "set", port, "up")


@dataclass
class LabPeer:
    """A ``peerd join`` process on a lab host; stdout and stderr go to its log file."""

    host: LabHost
    process: subprocess.Popen
    log_path: Path
    status_port: int = STATUS_PORT
    client_mode: bool = False
    last_status: dict[str, Any] = field(default_factory=dict)

    @property
    def address(self) -> str:
        return f"{self.host.address}:{PEER_PORT}"

    def alive(self) -> bool:
        return self.process.poll() is None

    def status(self, timeout: float = 2.0) -> dict[str, Any] | None:
        """``/status`` as JSON, or None while the peer does not answer (starting, dead, busy)."""
        if not self.alive():
            return None
        try:
            sock = connect_in(self.host.namespace, "127.0.0.1", self.status_port, timeout)
            with sock:
                sock.sendall(b"GET /status HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
                data = b""
                while chunk := sock.recv(65536):
                    data += chunk
        except OSError:
            return None
        head, _, body = data.partition(b"\r\n\r\n")
        if not head.startswith((b"HTTP/1.0 200", b"HTTP/1.1 200")):
            return None
        try:
            self.last_status = json.loads(body)
        except ValueError:
            return None
        return self.last_status

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.alive():
            self.process.send_signal(sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(5)

    def stop(self) -> int:
        if self.alive():
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


class Lab:
    """A private network of namespaces for one test; a context manager that removes all of it.

    ``add_host`` makes a public host on the hub's bridge; ``add_nat_host`` a private host behind its
    own NAT router; ``start_peer`` runs ``peerd join`` on a host. ``rate_mbit`` shapes both ends of
    the host's (or router's) link to the hub with tbf; None leaves the link unshaped.
    """

    def __init__(self, workdir: Path, tag: str = "lab"):
        self.workdir = workdir
        self.prefix = f"{PREFIX}{os.getpid()}-{tag}-"
        self.hub = f"{self.prefix}hub"
        self.namespaces: list[str] = []
        self.hosts: list[LabHost] = []
        self.peers: list[LabPeer] = []
        self.processes: list[subprocess.Popen] = []  # other processes started with ``spawn``
        self._next_public = 10
        self._next_private_net = 100

    def __enter__(self) -> Lab:
        try:
            self._namespace(self.hub)
            _run("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", self.hub, "link", "set", "br0", "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        # SIGTERM to all at once, then one shared grace period: stopping them one by one costs
        # up to a grace period per peer
        for peer in self.peers:
            if peer.alive():
                peer.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE
        for peer in self.peers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                peer.process.wait(max(0.0, deadline - time.monotonic()))
            if peer.alive():  # a finding of its own: peerd should end within the grace period
                print(f"netlab: peer on {peer.host.name} ignored SIGTERM for {STOP_GRACE} s; killed")
                peer.process.kill()
                peer.process.wait()
        for process in self.processes:
            if process.poll() is None:
                process.kill()
            process.wait()
            for pipe in (process.stdin, process.stdout):
                if pipe is not None:
                    pipe.close()
        for namespace in reversed(self.namespaces):
            _delete_namespace(namespace)
        self.namespaces.clear()

    def _namespace(self, name: str) -> str:
        _run("ip", "netns", "add", name)
        self.namespaces.append(name)
        _run("ip", "-n", name, "link", "set", "lo", "up")
        return name

    def _public_link(self, namespace: str, index: int, inner: str, rate_mbit: float | None) -> tuple[str, str]:
        """A veth from ``namespace`` (named ``inner``) into the hub's bridge; returns (address, hub port)."""
        address = f"{SUBNET}.0.{self._next_public}"
        self._next_public += 1
        hub_port = f"v{index}"
        _run("ip", "-n", self.hub, "link", "add", hub_port, "type", "veth", "peer", "name", inner, "netns", namespace)
        _run("ip", "-n", self.hub, "link", "set", hub_port, "master", "br0", "up")
        _run("ip", "-n", namespace, "addr", "add", f"{address}/24", "dev", inner)
        _run("ip", "-n", namespace, "link", "set", inner, "up")
        if rate_mbit is not None:
            self._shape(namespace, inner, rate_mbit)
            self._shape(self.hub, hub_port, rate_mbit)
        return address, hub_port

    @staticmethod
    def _shape(namespace: str, device: str, rate_mbit: float) -> None:
        _run(
            "tc", "-n", namespace, "qdisc", "add", "dev", device, "root", "tbf",
            "rate", f"{rate_mbit}mbit", "burst", TBF_BURST, "latency", TBF_LATENCY,
        )  # fmt: skip

    def add_host(self, name: str, rate_mbit: float | None = 100) -> LabHost:
        namespace = self._namespace(f"{self.prefix}{name}")
        address, hub_port = self._public_link(namespace, len(self.hosts), "eth0", rate_mbit)
        host = LabHost(self, name, namespace, address, hub_port, rate_mbit)
        self.hosts.append(host)
        return host

    def add_nat_host(self, name: str, rate_mbit: float | None = 100, *, random_ports: bool = False) -> LabHost:
        """A private host behind its own router that masquerades (``random_ports``: ``masquerade
        random``, a port-randomizing, symmetric-like NAT). The host can dial out; nobody can dial in."""
        router_ns = self._namespace(f"{self.prefix}{name}-nat")
        public, hub_port = self._public_link(router_ns, len(self.hosts), "wan", rate_mbit)
        router = LabHost(self, f"{name}-nat", router_ns, public, hub_port, rate_mbit)
        self.hosts.append(router)
        net = f"{SUBNET}.{self._next_private_net}"
        self._next_private_net += 1
        namespace = self._namespace(f"{self.prefix}{name}")
        _run("ip", "-n", router_ns, "link", "add", "lan", "type", "veth", "peer", "name", "eth0", "netns", namespace)
        _run("ip", "-n", router_ns, "addr", "add", f"{net}.1/24", "dev", "lan")
        _run("ip", "-n", router_ns, "link", "set", "lan", "up")
        _run("ip", "-n", namespace, "addr", "add", f"{net}.2/24", "dev", "eth0")
        _run("ip", "-n", namespace, "link", "set", "eth0", "up")
        _run("ip", "-n", namespace, "route", "add", "default", "via", f"{net}.1")
        _in(router_ns, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        masquerade = "masquerade random" if random_ports else "masquerade"
        # forward: only connections the inside opened come back in; postrouting: rewrite the source;
        # input: a connection from outside to the router itself is dropped, as a home router's
        # firewall does, rather than reset (a reset would also leave a conntrack entry that takes
        # the public port a hole-punching peer behind it is about to use)
        rules = f"""
table ip pdlab_nat {{
    chain input {{
        type filter hook input priority 0; policy accept;
        iifname "wan" ct state new drop
    }}
    chain forward {{
        type filter hook forward priority 0; policy drop;
        iifname "lan" oifname "wan" accept
        iifname "wan" oifname "lan" ct state established,related accept
    }}
    chain postrouting {{
        type nat hook postrouting priority 100;
        oifname "wan" {masquerade}
    }}
}}
"""
        _in(router_ns, "nft", "-f", "-", input=rules)
        host = LabHost(self, name, namespace, f"{net}.2", None, rate_mbit, router=router)
        self.hosts.append(host)
        return host

    def start_peer(
        self,
        host: LabHost,
        *,
        run_id: str,
        initial_peer: str | None = None,
        client_mode: bool = False,
        extra: list[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> LabPeer:
        """``peerd join`` on ``host`` (listening on PEER_PORT unless ``client_mode``); returns at once."""
        index = len(self.peers)
        args = [
            "join",
            "--listen", f"{host.address}:{PEER_PORT}",
            "--identity", str(self.workdir / f"peer{index}.key"),
            "--run-id", run_id,
            "--status-port", str(STATUS_PORT),
        ]  # fmt: skip
        if client_mode:
            args.append("--client-mode")
        if initial_peer:
            args += ["--initial-peer", initial_peer]
        args += extra or []
        log_path = self.workdir / f"peer{index}-{host.name}.log"
        child_env = dict(os.environ, **(env or {}), PYTHONUNBUFFERED="1")
        child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), child_env.get("PYTHONPATH")]))
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                ["ip", "netns", "exec", host.namespace, *PEERD, *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=child_env,
                cwd=REPO,
            )
        peer = LabPeer(host, process, log_path, client_mode=client_mode)
        self.peers.append(peer)
        return peer

    def spawn(self, host: LabHost, args: list[str], log_path: Path, python: str = sys.executable) -> subprocess.Popen:
        """A Python process (``args`` after the interpreter, ``python``: another one may hold other
        packages) in ``host``'s namespace with pipes for stdin and stdout and stderr to
        ``log_path``; killed when the lab closes."""
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                ["ip", "netns", "exec", host.namespace, python, *args],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=env,
                cwd=REPO,
            )
        self.processes.append(process)
        return process

    def run_in(self, host: LabHost, args: list[str], timeout: float) -> subprocess.CompletedProcess:
        """Run a Python command (``args`` after the interpreter) inside ``host``'s namespace."""
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        command = ["ip", "netns", "exec", host.namespace, sys.executable, *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)

    def wait_started(self, peers: list[LabPeer], timeout: float = START_TIMEOUT) -> None:
        """Until every peer's ``/status`` answers; a peer that exits first fails with its log."""
        deadline = time.monotonic() + timeout
        waiting = list(peers)
        while waiting:
            for peer in list(waiting):
                if not peer.alive():
                    raise AssertionError(f"peer on {peer.host.name} exited ({peer.process.returncode}):\n{peer.tail()}")
                if peer.status() is not None:
                    waiting.remove(peer)
            if waiting and time.monotonic() > deadline:
                names = ", ".join(peer.host.name for peer in waiting)
                raise AssertionError(f"no /status from {names} within {timeout} s:\n{waiting[0].tail()}")
            time.sleep(0.25)

    def start_swarm(
        self, hosts: list[LabHost], *, run_id: str, extra: list[str] | None = None, client: set[int] = frozenset()
    ) -> list[LabPeer]:
        """One ``peerd join --task ...`` per host, host 0 the initial peer of the others, each on its
        own data shard (``extra`` adds flags to all; indices in ``client`` join in client mode).
        Returns once every peer's ``/status`` answers."""
        peers = []
        for index, host in enumerate(hosts):
            flags = ["--data-shard", f"{index}/{len(hosts)}", *(extra or [])]
            initial = f"{hosts[0].address}:{PEER_PORT}" if index else None
            peers.append(
                self.start_peer(host, run_id=run_id, initial_peer=initial, client_mode=index in client, extra=flags)
            )
            if index == 0:  # the others bootstrap from it: it must listen first
                self.wait_started(peers)
        self.wait_started(peers)
        return peers

    def wait_for(self, predicate, timeout: float, what: str, interval: float = 0.5) -> float:
        """Poll ``predicate`` until true; returns the seconds it took, or fails with every peer's log."""
        start = time.monotonic()
        while not predicate():
            if time.monotonic() - start > timeout:
                raise AssertionError(f"timed out after {timeout} s waiting for {what}\n{self.logs()}")
            time.sleep(interval)
        return time.monotonic() - start

    def logs(self, lines: int = 15) -> str:
        """The tail of every peer's log, for a failing assertion's message."""
        return "\n".join(f"--- {peer.host.name} ({peer.log_path}):\n{peer.tail(lines)}" for peer in self.peers)
