"""What one stored object costs beyond its own pages: ``python -m bench.object_overhead``.

``--memory-limit`` counts object buffers (at least 4 KiB each); the key, its index entries and
the object's record are Python objects outside it. This starts a server, stores ``--objects``
objects of 4 KiB under keys of each ``--key-lengths``, and prints the server's RSS growth
beyond the objects' pages, per object (docs/operating.md, "Limits and timeouts").

    python -m bench.object_overhead
    python -m bench.object_overhead --objects 200000 --key-lengths 16,64,140
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import psutil

from lmclient import Client

from .targets import start_lmserver

OBJECT = 4096
BATCH = 500


def overhead_per_object(objects: int, key_length: int) -> float:
    """Bytes of server RSS per object beyond the object's own 4 KiB page."""
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as tmp:
        target = start_lmserver("lmserver", Path(tmp), None, [], f"{objects * OBJECT * 2}")
        try:
            if target.spec is None or target.pid is None:
                raise SystemExit(f"lmserver did not start: {target.note}")
            process = psutil.Process(target.pid)
            with Client(target.spec.host, target.spec.port) as client:
                client.put("warm-up", bytes(OBJECT), ack=True)  # connection and first slab
                before = process.memory_info().rss
                keys = [f"{i:08}".ljust(key_length, "k") for i in range(objects)]
                body = b"v" * OBJECT
                for first in range(0, objects, BATCH):
                    part = keys[first : first + BATCH]
                    client.put_many(part, [body] * len(part), ack=True)
                after = process.memory_info().rss
            return (after - before - objects * OBJECT) / objects
        finally:
            target.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objects", type=int, default=100_000)
    parser.add_argument("--key-lengths", default="16,140", help="comma list of key lengths (8 to 150)")
    args = parser.parse_args()
    print("| key length | bytes per object beyond its pages |")
    print("|---|---|")
    for length in (int(k) for k in args.key_lengths.split(",")):
        print(f"| {length} | {overhead_per_object(args.objects, length):,.0f} |", flush=True)


if __name__ == "__main__":
    main()
