"""What the host itself was like while a bench ran, printed beside the bench's figures.

Why: on the shared development VM one client's sequential requests have run at 8k, 12k and
40k per second on different days with the same build, and Redis moved with them. A ratio
measured in interleaved rounds survives that, but a reader comparing two runs, or judging
how noisy a run was, needs to know which kind of host each ran on. Two measures:

- the *host probe*: one client's sequential EXISTs against the raw peer (bench/rawserver.py,
  which answers without looking anything up), before the first cell and after the last. It
  is the round trip any server pays on this host at that time: the wake-ups, the loopback,
  the client. A large difference between the two says the host changed during the run.
- CPU *steal*: the share of the run's CPU time the hypervisor gave to other guests
  (``/proc/stat``), which a busy host shows and a quiet one does not.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

PROBE_SECONDS = 1.0
PROBE_CHANGE = 0.25
"""Before and after probes further apart than this (relative to the faster) flag the run."""
STEAL_LIMIT = 0.02
"""A run where the hypervisor took more than this share of the CPU time is flagged."""


@dataclass(frozen=True)
class CpuTicks:
    steal: int
    total: int


def cpu_ticks(stat: Path = Path("/proc/stat")) -> CpuTicks | None:
    """The machine's cumulative CPU ticks and, of them, steal; None where there is no
    ``/proc/stat`` (not Linux) or its first line is not the aggregate ``cpu`` line."""
    try:
        first = stat.read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    if not first or first[0] != "cpu" or len(first) < 9:
        return None
    ticks = [int(v) for v in first[1:]]
    # user nice system idle iowait irq softirq steal [guest guest_nice]: guest time is
    # already counted in user and nice, so the first eight are the whole.
    return CpuTicks(steal=ticks[7], total=sum(ticks[:8]))


def steal_share(before: CpuTicks | None, after: CpuTicks | None) -> float | None:
    if before is None or after is None or after.total <= before.total:
        return None
    return (after.steal - before.steal) / (after.total - before.total)


def warnings(probe_before: float | None, probe_after: float | None, steal: float | None) -> list[str]:
    """Why this run's figures may carry the host rather than the servers (none: no reason)."""
    found = []
    if probe_before and probe_after:
        change = abs(probe_before - probe_after) / max(probe_before, probe_after)
        if change > PROBE_CHANGE:
            found.append(
                f"the host probe moved by {change:.0%} between the start and the end of the run: "
                "the host changed under it"
            )
    if steal is not None and steal > STEAL_LIMIT:
        found.append(f"the hypervisor took {steal:.1%} of the CPU time (steal): other guests were busy")
    return found


def describe(probe_before: float | None, probe_after: float | None, steal: float | None) -> str:
    def rate(v: float | None) -> str:
        return "-" if v is None else f"{v / 1e3:.1f}k"

    line = (
        f"host: a raw peer answered one client's sequential EXISTs at {rate(probe_before)}/s "
        f"before the cells and {rate(probe_after)}/s after"
    )
    if steal is not None:
        line += f"; CPU steal {steal:.1%} of the run"
    return line + "".join(f"\nwarning: {w}" for w in warnings(probe_before, probe_after, steal))
