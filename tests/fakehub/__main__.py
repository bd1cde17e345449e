"""``python -m fakehub ROOT [BUCKET ...] [--host ADDR] [--port N] [--xet-token-ttl S]``: run the
fake Hub (and its storage service) in its own process: benchmarks, so its HTTP handling does
not compete with the measured process for the GIL, and fleets of servers in network
namespaces, which reach it at ``--host``. Prints the endpoint on one line, then serves until
stdin closes."""

from __future__ import annotations

import argparse
import pathlib
import sys

from . import FakeHub


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m fakehub")
    ap.add_argument("root", type=pathlib.Path)
    ap.add_argument("buckets", nargs="*")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--xet-token-ttl", type=float, default=3600.0)
    args = ap.parse_args()
    hub = FakeHub(args.root, host=args.host, xet_token_ttl_s=args.xet_token_ttl)
    hub.port = args.port
    hub.start()
    for bucket in args.buckets:
        hub.create(bucket)
    print(hub.endpoint, flush=True)
    sys.stdin.read()
    hub.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
