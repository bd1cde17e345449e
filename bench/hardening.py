"""What misbehaving peers cost a running server (issue 32's figures), each as one command:

    python -m bench.hardening handshakes      # RSS per pending TLS handshake and per idle TLS connection
    python -m bench.hardening lockout         # a reconnecting crowd of idle sockets vs one polite client
    python -m bench.hardening metrics-sockets # threads and fds that silent sockets on --metrics-port cost
    python -m bench.hardening scrape-storm    # 4 KiB GET latency while 20 clients scrape /metrics
    python -m bench.hardening all --base-pythonpath /tmp/base   # every one, also for an older tree

Each starts a fresh ``python -m lmserver`` on loopback (``--base-pythonpath``: another source
tree, built in place or pure) and drives it from this process and its children. Figures are
for one host at one time: compare the two trees within one run, never across runs.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import multiprocessing
import selectors
import socket
import statistics
import subprocess
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil

from lmclient import Client

from .metrics_cost import start

KiB = 1024


@contextlib.contextmanager
def server(extra: list[str], pythonpath: str | None) -> Iterator[dict[str, Any]]:
    proc, info = start(extra, pythonpath)
    info["pid"] = proc.pid
    # The log pipe must keep draining (refusals log warnings) or the server blocks on stderr.
    assert proc.stderr is not None
    drain = threading.Thread(target=proc.stderr.read, daemon=True)
    drain.start()
    try:
        yield info
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def rss(pid: int) -> int:
    return int(psutil.Process(pid).memory_info().rss)


def settled_rss(pid: int, seconds: float = 1.0, limit: float = 15.0) -> int:
    """RSS once it has not changed by more than 64 KiB for ``seconds`` (or after ``limit``)."""
    deadline = time.monotonic() + limit
    last, since = rss(pid), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = rss(pid)
        if abs(now - last) > 64 * KiB:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= seconds:
            break
    return last


def self_signed(folder: Path) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return cert_path, key_path


def open_silent(port: int, count: int, source: str = "127.0.0.1") -> list[socket.socket]:
    """``count`` connections that send nothing (refused ones are kept too: a peer does not know)."""
    socks = []
    for _ in range(count):
        sock = socket.socket()
        sock.bind((source, 0))
        sock.connect(("127.0.0.1", port))
        socks.append(sock)
    return socks


# -- handshakes ------------------------------------------------------------------------------


def handshakes(pythonpath: str | None, count: int, idle: int) -> list[str]:
    lines = []
    with tempfile.TemporaryDirectory() as folder:
        cert, key = self_signed(Path(folder))
        for loop in ("uvloop", "asyncio"):
            tls = ["--loop", loop, "--tls-port", "0", "--tls-cert", str(cert), "--tls-key", str(key)]
            for limits in (("100", "50"), ("4096", "4096")):
                extra = [*tls, "--max-connections", limits[0], "--max-connections-per-address", limits[1]]
                with server(extra, pythonpath) as info:
                    lines.append(f"{loop:8} " + silent_tls(info, count, limits))
                    if limits[0] == "100":
                        lines.append(f"{loop:8} " + idle_tls(info["pid"], int(info["tls_port"]), idle))
    return lines


def silent_tls(info: dict[str, Any], count: int, limits: tuple[str, str]) -> str:
    """RSS, fds and slots that ``count`` sockets on the TLS port cost, sending nothing."""
    pid, port = info["pid"], int(info["tls_port"])
    with Client("127.0.0.1", int(info["port"])) as client:
        client.health()
    before, fds_before = settled_rss(pid), psutil.Process(pid).num_fds()
    socks = open_silent(port, count, "127.0.0.2")  # one address
    time.sleep(1.0)  # well inside the 10 s handshake timeout
    held = rss(pid)
    fds = psutil.Process(pid).num_fds()
    pending = fds - fds_before  # sockets the server holds (STATS counted none before issue 32)
    for sock in socks:
        sock.close()
    after = settled_rss(pid, seconds=2.0)
    return (
        f"{count} silent sockets on the TLS port (--max-connections {limits[0]}, per address {limits[1]}): "
        f"RSS +{(held - before) / 2**20:.1f} MiB, handshakes held {pending} "
        f"({(held - before) / max(1, pending) / KiB:.1f} KiB each), server fds {fds}; "
        f"after they close: +{(after - before) / 2**20:.1f} MiB"
    )


def idle_tls(pid: int, tls_port: int, count: int) -> str:
    """RSS per TLS connection that made one request and went idle (buffers given back)."""
    import ssl

    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    before = settled_rss(pid)
    conns = [Client("127.0.0.1", tls_port, ssl=context) for _ in range(count)]
    try:
        for client in conns:
            client.health()
        time.sleep(3.0)  # idle staging buffers are given back by the sweep (~1 s)
        held = settled_rss(pid)
    finally:
        for client in conns:
            client.close()
    return f"{count} idle TLS connections: {(held - before) / count / KiB:.1f} KiB of RSS each"


# -- lockout ---------------------------------------------------------------------------------


def crowd(port: int, sockets: int, sources: list[str], stop_at: float) -> None:
    """Idle sockets from ``sources`` that reconnect the moment the server closes one."""
    selector = selectors.DefaultSelector()

    def connect(source: str) -> None:
        sock = socket.socket()
        sock.setblocking(False)
        sock.bind((source, 0))
        with contextlib.suppress(BlockingIOError):
            sock.connect(("127.0.0.1", port))
        selector.register(sock, selectors.EVENT_READ, source)

    for i in range(sockets):
        connect(sources[i % len(sources)])
    while time.monotonic() < stop_at:
        for key, _ in selector.select(0.1):
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            try:
                data = sock.recv(4096)
            except OSError:
                data = b""
            if not data:  # closed (or refused): reconnect at once
                selector.unregister(sock)
                sock.close()
                connect(key.data)


def lockout(pythonpath: str | None, seconds: float, sockets: int) -> list[str]:
    extra = ["--max-connections", str(sockets), "--idle-timeout", "1"]
    with server(extra, pythonpath) as info:
        port = int(info["port"])
        stop_at = time.monotonic() + seconds + 3
        sources = [f"127.0.0.{i}" for i in range(2, 7)]
        proc = multiprocessing.get_context("spawn").Process(
            target=crowd, args=(port, sockets, sources, stop_at)
        )
        proc.start()
        time.sleep(3.0)  # the crowd fills the server
        tries = answered = 0
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            tries += 1
            with contextlib.suppress(Exception), Client("127.0.0.1", port, retry=0, timeout=2.0) as client:
                answered += bool(client.health())
            time.sleep(0.25)
        proc.join(seconds + 30)
        with Client("127.0.0.1", port) as client:
            counters = client.stats()["counters"]
    shown = {k: v for k, v in counters.items() if k.startswith(("connections", "idle"))}
    return [f"a crowd of {sockets} reconnecting idle sockets ({len(sources)} addresses) for {seconds:.0f} s: "
            f"a polite client's HEALTH answered {answered} of {tries} times; {shown}"]  # fmt: skip


# -- metrics sockets -------------------------------------------------------------------------


def metrics_sockets(pythonpath: str | None, count: int) -> list[str]:
    with server(["--metrics-port", "0"], pythonpath) as info:
        pid, mport, port = info["pid"], int(info["metrics_port"]), int(info["port"])
        process = psutil.Process(pid)
        threads0, fds0 = process.num_threads(), process.num_fds()
        socks = open_silent(mport, count)
        time.sleep(2.0)
        threads1, fds1 = process.num_threads(), process.num_fds()
        with Client("127.0.0.1", port) as client:
            client.put("k", b"x" * 4 * KiB)
            stop = threading.Event()
            worst: list[float] = []
            getter = threading.Thread(target=_time_gets, args=(client, stop, worst))
            getter.start()
            time.sleep(0.5)
            for sock in socks:
                sock.close()
            time.sleep(3.0)
            stop.set()
            getter.join()
        threads2, fds2 = process.num_threads(), process.num_fds()
    return [
        f"{count} silent sockets on --metrics-port: server threads {threads0} -> {threads1}, fds {fds0} -> "
        f"{fds1}; 3 s after they close: threads {threads2}, fds {fds2}; slowest 4 KiB GET while "
        f"they closed: {max(worst) * 1e3:.1f} ms"
    ]


def _time_gets(client: Client, stop: threading.Event, out: list[float]) -> None:
    while not stop.is_set():
        t0 = time.perf_counter()
        client.get("k")
        out.append(time.perf_counter() - t0)


# -- scrape storm ----------------------------------------------------------------------------


def scrape_forever(port: int, stop_at: float) -> None:
    while time.monotonic() < stop_at:
        with (
            contextlib.suppress(OSError),
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response,
        ):
            response.read()


def scraper_process(port: int, scrapers: int, stop_at: float) -> None:
    threads = [threading.Thread(target=scrape_forever, args=(port, stop_at)) for _ in range(scrapers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def scrape_storm(pythonpath: str | None, seconds: float, scrapers: int) -> list[str]:
    lines = []
    with server(["--metrics-port", "0"], pythonpath) as info:
        port, mport = int(info["port"]), int(info["metrics_port"])
        with Client("127.0.0.1", port) as client:
            client.put("k", b"x" * 4 * KiB)
            for label, storm in (("quiet", 0), (f"{scrapers} scrapers", scrapers), ("quiet again", 0)):
                proc = None
                if storm:
                    stop_at = time.monotonic() + seconds + 1
                    proc = multiprocessing.get_context("spawn").Process(
                        target=scraper_process, args=(mport, storm, stop_at)
                    )
                    proc.start()
                    time.sleep(1.0)
                samples, scrapes = timed_gets(client, seconds), None
                if proc is not None:
                    proc.join(seconds + 30)
                    with urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=10) as response:
                        scrapes = response.read().count(b"\n")
                shown = f" ({scrapes} lines per scrape)" if scrapes else ""
                lines.append(f"4 KiB GET, {label}: {summary(samples)}{shown}")
    return lines


def timed_gets(client: Client, seconds: float) -> list[float]:
    samples = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.perf_counter()
        client.get("k")
        samples.append(time.perf_counter() - t0)
    return samples


def summary(samples: list[float]) -> str:
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return (
        f"{len(samples)} GETs, p50 {statistics.median(samples) * 1e3:.2f} ms, p99 {p99 * 1e3:.2f} ms, "
        f"max {ordered[-1] * 1e3:.1f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["handshakes", "lockout", "metrics-sockets", "scrape-storm", "all"])
    parser.add_argument("--base-pythonpath", help="also measure this source tree, first")
    parser.add_argument("--sockets", type=int, default=0, help="sockets per test (default: per test)")
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    runs: dict[str, Callable[[str | None], list[str]]] = {
        "handshakes": lambda path: handshakes(path, args.sockets or 3000, 200),
        "lockout": lambda path: lockout(path, args.seconds, args.sockets or 1024),
        "metrics-sockets": lambda path: metrics_sockets(path, args.sockets or 2000),
        "scrape-storm": lambda path: scrape_storm(path, args.seconds, 20),
    }
    chosen = list(runs) if args.what == "all" else [args.what]
    trees = ([("base", args.base_pythonpath)] if args.base_pythonpath else []) + [("this", None)]
    for what in chosen:
        for name, path in trees:
            for line in runs[what](path):
                print(f"{what} [{name}] {line}", flush=True)


if __name__ == "__main__":
    main()
