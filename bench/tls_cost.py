"""What TLS costs: 4 MiB PUT_ACK and GET over lms:// against the same server's plain port.

    python -m bench.tls_cost --seconds 3 --rounds 3

One ``python -m lmserver`` serves both listeners (a self-signed certificate made with the
``openssl`` command); one blocking `lmclient.Client` per transport runs sequential PUT_ACKs,
then sequential ``get_into`` calls into a preallocated buffer, for ``--seconds`` each, plain
and TLS alternating round by round. Prints medians of GB/s and server CPU seconds per GB.
"""

from __future__ import annotations

import argparse
import json
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from lmclient import Client


def make_certificate(folder: Path) -> tuple[Path, Path]:
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


def measure(
    client: Client, server: psutil.Process, op: str, size: int, seconds: float
) -> tuple[float, float]:
    body = bytes(size)
    into = bytearray(size)
    client.put("tls-cost", body, ack=True)
    cpu0 = sum(server.cpu_times()[:2])
    t0 = time.perf_counter()
    moved = 0
    while time.perf_counter() - t0 < seconds:
        if op == "put":
            client.put("tls-cost", body, ack=True)
        else:
            client.get_into("tls-cost", into)
        moved += size
    elapsed = time.perf_counter() - t0
    cpu = sum(server.cpu_times()[:2]) - cpu0
    return moved / elapsed / 1e9, cpu / (moved / 1e9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--size", type=int, default=4 * 1024 * 1024)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cert, key = make_certificate(Path(tmp))
        cmd = [sys.executable, "-m", "lmserver", "--port", "0", "--tls-port", "0", "--tls-cert", str(cert),
               "--tls-key", str(key), "--log-format", "json", "--memory-limit", "1GiB"]  # fmt: skip
        proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL)
        assert proc.stderr is not None
        info = next(e for e in map(json.loads, proc.stderr) if e.get("event") == "listening")
        server = psutil.Process(proc.pid)
        context = ssl.create_default_context(cafile=str(cert))
        clients = {
            "plain": Client("127.0.0.1", int(info["port"]), max_connections=1),
            "tls": Client("127.0.0.1", int(info["tls_port"]), ssl=context, max_connections=1),
        }
        results: dict[tuple[str, str], list[tuple[float, float]]] = {}
        try:
            for _ in range(args.rounds):
                for op in ("put", "get"):
                    for name, client in clients.items():
                        results.setdefault((op, name), []).append(
                            measure(client, server, op, args.size, args.seconds)
                        )
        finally:
            for client in clients.values():
                client.close()
            proc.terminate()
            proc.wait(30)
    print(f"{args.size >> 20} MiB objects, sequential, {args.rounds} rounds x {args.seconds}s, medians")
    print("op   transport  GB/s   ratio  srv CPU s/GB")
    for op in ("put", "get"):
        plain = statistics.median(g for g, _ in results[(op, "plain")])
        for name in ("plain", "tls"):
            gbps = statistics.median(g for g, _ in results[(op, name)])
            cpu = statistics.median(c for _, c in results[(op, name)])
            print(f"{op:4} {name:9} {gbps:6.2f}  {gbps / plain:5.2f}  {cpu:8.3f}")


if __name__ == "__main__":
    main()
