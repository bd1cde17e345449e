"""``python -m fakehub ROOT [BUCKET ...]``: run the fake Hub in its own process (benchmarks:
its HTTP handling then does not compete with the measured process for the GIL). Prints
the endpoint on one line, then serves until stdin closes."""

from __future__ import annotations

import pathlib
import sys

from . import FakeHub


def main() -> int:
    hub = FakeHub(pathlib.Path(sys.argv[1])).start()
    for bucket in sys.argv[2:]:
        hub.create(bucket)
    print(hub.endpoint, flush=True)
    sys.stdin.read()
    hub.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
