"""Whether DELETE_MANY and LIST_PAGE pay off: ``python -m bench.bulk``.

Strategy: one lmserver on loopback, one lmclient ``Client``. Deletes: ``--keys`` small objects
are stored, then deleted in batches of ``--batch`` (an L2 eviction batch) once with
DELETE_MANY (one request per connection) and once with pipelined DELETEs (what lmclient sends
to a server without DELETE_MANY), alternating over ``--rounds``. Listing: all ``--keys`` keys
are walked in pages of ``--page`` with LIST_PAGE, against what a client without it must do for
each page: a LIST of every key (it has no cursor), cut to the page. Medians over rounds and
the ratio; nothing is asserted.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from lmclient import Client

from .targets import start_lmserver


def _timed(action: Callable[[], object]) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def _deletes(client: Client, keys: list[str], batch: int, many: bool) -> float:
    client.put_many(keys, [b"v"] * len(keys), ack=True)
    client._delete_many = many  # False: the fallback an older server gets
    seconds = 0.0
    for start in range(0, len(keys), batch):
        part = keys[start : start + batch]
        seconds += _timed(lambda part=part: client.delete_many(part))
    client._delete_many = True
    return seconds


def _walk_pages(client: Client, page: int) -> int:
    after: str | None = ""
    pages = 0
    while after is not None:
        _, after = client.list_page("bulk/", after=after, limit=page)
        pages += 1
    return pages


def _walk_lists(client: Client, page: int, total: int) -> int:
    pages = 0
    for start in range(0, total, page):
        client.list("bulk/")[start : start + page]  # a LIST has no cursor: every page sends all
        pages += 1
    return pages


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.bulk", description=__doc__.splitlines()[0])
    ap.add_argument("--keys", type=int, default=20_000, help="objects stored")
    ap.add_argument("--batch", type=int, default=512, help="keys per delete call")
    ap.add_argument("--page", type=int, default=1000, help="keys per listing page")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        target = start_lmserver("lmserver", Path(tmp), None, [], "1GiB")
        if target.spec is None:
            raise SystemExit(f"lmserver did not start: {target.note}")
        try:
            with Client("127.0.0.1", target.spec.port) as client:
                keys = [f"bulk/{i:08}@00000000@0@{i:064x}" for i in range(args.keys)]
                many, single = [], []
                for rnd in range(args.rounds):
                    order = (True, False) if rnd % 2 == 0 else (False, True)
                    for use_many in order:
                        (many if use_many else single).append(_deletes(client, keys, args.batch, use_many))
                client.put_many(keys, [b"v"] * len(keys), ack=True)
                paged, listed = [], []
                for _ in range(args.rounds):
                    paged.append(_timed(lambda: _walk_pages(client, args.page)))
                    listed.append(_timed(lambda: _walk_lists(client, args.page, len(keys))))
        finally:
            target.stop()
    per_key = 1e6 / args.keys
    m, s = statistics.median(many), statistics.median(single)
    p, x = statistics.median(paged), statistics.median(listed)
    print(f"{args.keys} keys, {args.rounds} rounds, medians")
    print(f"delete in batches of {args.batch}: DELETE_MANY {m * per_key:.2f} us/key, pipelined DELETE")
    print(f"  {s * per_key:.2f} us/key: x{s / m:.1f}")
    print(f"walk in pages of {args.page}: LIST_PAGE {p * 1e3:.0f} ms,")
    print(f"  a LIST per page {x * 1e3:.0f} ms: x{x / p:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
