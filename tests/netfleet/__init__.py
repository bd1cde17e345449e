"""A fleet of hosts on a private network of Linux network namespaces, for the fleet tests
(``tests/fleet``) and benchmark (``bench/fleet.py``). Test infrastructure, not product code.

Strategy: one namespace is the *switch* (a bridge, ``br0``) and also the storage host, at
``10.77.0.1``; every other host is a namespace with one interface, ``eth0``, cabled by a veth
pair to a port of the bridge, at ``10.77.0.N``. Nothing is added to the namespace this process
runs in, so another engineer's fleet can never collide with this one: every name carries a
tag with this process's PID, and the address plan lives inside the namespaces. Taking a
host's link down sets its switch port down, as a pulled cable does: its packets are dropped
without a reset, so a client sees timeouts, not refusals.

Processes run on a host through ``ip netns exec`` (which execs: the PID is the program's).
Code of this process talks from a host through `Network.thread`: a one-thread executor whose
thread has entered the host's namespace (``setns`` changes only the calling thread), so the
sockets it opens live there. `Network.close` ends every process started here (by its PID)
and deletes every namespace, which deletes their interfaces with them; it runs at exit too.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import ctypes
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

SUBNET = "10.77.0"
SWITCH_ADDRESS = f"{SUBNET}.1"
CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def unavailable() -> str | None:
    """Why a fleet cannot be built here, or None when it can."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    probe = f"lmfprobe{os.getpid()}"
    done = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if done.returncode != 0:
        return f"creating a network namespace is not permitted here: {done.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def enter(netns: str) -> None:
    """Move the calling thread into the network namespace ``netns``."""
    fd = os.open(f"/run/netns/{netns}", os.O_RDONLY)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({netns}): {os.strerror(err)}")
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Host:
    name: str  # as the caller named it: "h1", "client"
    netns: str
    address: str
    port: str  # its switch port (the veth end on the bridge)


class Network:
    def __init__(self, tag: str | None = None) -> None:
        self.tag = tag or f"lmf{os.getpid()}"
        self.switch = Host("switch", f"{self.tag}sw", SWITCH_ADDRESS, "br0")
        self.hosts: dict[str, Host] = {}
        self._namespaces: list[str] = []
        self._procs: list[subprocess.Popen[Any]] = []
        self._threads: list[concurrent.futures.ThreadPoolExecutor] = []
        atexit.register(self.close)
        try:
            self._netns_add(self.switch.netns)
            self._ip(self.switch, "link", "add", "br0", "type", "bridge")
            self._ip(self.switch, "addr", "add", f"{SWITCH_ADDRESS}/24", "dev", "br0")
            self._ip(self.switch, "link", "set", "br0", "up")
        except BaseException:
            self.close()
            raise

    def add(self, name: str) -> Host:
        """A new host on the switch, at the next address."""
        number = len(self.hosts) + 11
        host = Host(name, f"{self.tag}{name}", f"{SUBNET}.{number}", f"v{os.getpid()}n{number}"[:15])
        self._netns_add(host.netns)
        self._ip(
            self.switch, "link", "add", host.port, "type", "veth", "peer", "name", "eth0", "netns", host.netns
        )
        self._ip(self.switch, "link", "set", host.port, "master", "br0", "up")
        self._ip(host, "addr", "add", f"{host.address}/24", "dev", "eth0")
        self._ip(host, "link", "set", "eth0", "up")
        self.hosts[name] = host
        return host

    def link(self, host: Host, up: bool) -> None:
        """Plug (``up``) or pull the host's cable: its switch port goes up or down."""
        self._ip(self.switch, "link", "set", host.port, "up" if up else "down")

    def shape(self, host: Host, rate: str) -> None:
        """Give the host's link a rate (``1gbit``, ``100mbit``, ``500kbit``), both ways, as a
        NIC of that speed would: its own egress and its switch port's. The token bucket holds
        10 ms at that rate (at least 64 KiB), so bursts barely exceed it."""
        burst = str(max(64 * 1024, int(bits_per_second(rate) / 8 / 100)))
        for netns, dev in ((host.netns, "eth0"), (self.switch.netns, host.port)):
            _run(["tc", "-n", netns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
                  "burst", burst, "latency", "50ms"])  # fmt: skip

    def command(self, host: Host) -> list[str]:
        """The prefix that runs a command on ``host``."""
        return ["ip", "netns", "exec", host.netns]

    def popen(self, host: Host, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start a program on ``host``; `close` ends it if it is still running."""
        proc = subprocess.Popen([*self.command(host), *argv], **kwargs)
        self._procs.append(proc)
        return proc

    def thread(self, host: Host) -> concurrent.futures.ThreadPoolExecutor:
        """A one-thread executor whose thread lives in ``host``'s network namespace."""
        pool = concurrent.futures.ThreadPoolExecutor(
            1, f"on-{host.name}", initializer=enter, initargs=(host.netns,)
        )
        self._threads.append(pool)
        return pool

    def close(self) -> None:
        """End what was started here and delete every namespace; idempotent."""
        for pool in self._threads:
            pool.shutdown(wait=True, cancel_futures=True)
        self._threads.clear()
        for proc in self._procs:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()
        self._procs.clear()
        for netns in reversed(self._namespaces):
            subprocess.run(["ip", "netns", "del", netns], capture_output=True)
        self._namespaces.clear()
        atexit.unregister(self.close)

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plumbing ----------------------------------------------------------------------------

    def _netns_add(self, netns: str) -> None:
        subprocess.run(["ip", "netns", "del", netns], capture_output=True)  # a stale one, if any
        _run(["ip", "netns", "add", netns])
        self._namespaces.append(netns)
        _run(["ip", "-n", netns, "link", "set", "lo", "up"])

    def _ip(self, host: Host, *args: str) -> None:
        _run(["ip", "-n", host.netns, *args])


def bits_per_second(rate: str) -> float:
    """``1gbit`` -> 1e9 (``tc``'s units)."""
    for suffix, scale in (("kbit", 1e3), ("mbit", 1e6), ("gbit", 1e9), ("bit", 1.0)):
        if rate.endswith(suffix):
            return float(rate[: -len(suffix)]) * scale
    raise ValueError(f"a rate such as 1gbit or 100mbit, not {rate!r}")


def _run(argv: list[str]) -> None:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")
