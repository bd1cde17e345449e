"""Turning client results into figures, ratios, tables, JSON and plots.

Strategy: a cell's throughput is the sum of what every client moved over the union of
their timed windows (earliest start to latest end, one shared monotonic clock), so slow
stragglers count. Ratios are computed after the whole run from the stored cells, so the
physical limit and redis were measured on the same machine in the same run.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from .worker import ClientResult

CDF_QUANTILES = [q / 100 for q in range(100)] + [0.995, 0.999, 1.0]
BYTE_OPS = ("put", "get", "mixed", "stream_put", "stream_get")
REDIS_NAMES = ("redis-local",)


def fmt_size(n: int) -> str:
    for unit, mult in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= mult and n % mult == 0:
            return f"{n // mult} {unit}"
    return f"{n} B"


def parse_size(text: str) -> int:
    t = text.strip().upper().replace(" ", "").removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    return int(float(t[:-1] if mult > 1 else t) * mult)


def op_label(op: str, depth: int) -> str:
    if op.startswith("stream"):
        return op
    return f"{op} {'seq' if depth == 1 else f'pipe{depth}'}"


def summarize_cell(results: list[ClientResult], size: int) -> dict[str, Any]:
    good = [r for r in results if r.error is None and r.end_ns > r.start_ns]
    errors = [r.error for r in results if r.error]
    out: dict[str, Any] = {"client_errors": errors[:4], "clients_ok": len(good)}
    if not good:
        out.update(ops=0, bytes=0, seconds=0.0, gbps=None, ops_per_s=None, lat_us=None, cdf_us=None)
        out["hits"] = 0
        return out
    window = (max(r.end_ns for r in good) - min(r.start_ns for r in good)) / 1e9
    ops = sum(r.ops for r in good)
    nbytes = sum(r.nbytes for r in good)
    lat = np.concatenate([np.frombuffer(r.lat_ns, dtype=np.int64) for r in good if len(r.lat_ns)] or [[0]])
    lat_us = lat.astype(np.float64) / 1e3
    out.update(
        ops=ops,
        hits=sum(r.hits for r in good),
        bytes=nbytes,
        seconds=window,
        gbps=nbytes / window / 1e9 if window > 0 and nbytes else None,
        ops_per_s=ops / window if window > 0 else None,
        samples=len(lat) if any(len(r.lat_ns) for r in good) else 0,
        per_client=[[r.ops, round((r.end_ns - r.start_ns) / 1e9, 4)] for r in good],
    )
    if out["samples"]:
        q = np.quantile(lat_us, [0.5, 0.99, 0.999])
        out["lat_us"] = {
            "p50": float(q[0]),
            "p99": float(q[1]),
            "p999": float(q[2]),
            "mean": float(lat_us.mean()),
            "max": float(lat_us.max()),
        }
        out["cdf_us"] = [round(float(v), 2) for v in np.quantile(lat_us, CDF_QUANTILES)]
    else:
        out["lat_us"] = None
        out["cdf_us"] = None
    return out


def _key(c: dict[str, Any]) -> tuple[str, int, int, int]:
    return c["op"], c["depth"], c["size"], c["clients"]


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return a / b


def compute_ratios(cells: list[dict[str, Any]]) -> None:
    """Add ``ratio_phys``, ``ratio_raw_same`` and ``ratio_redis`` to every cell in place.

    ratio_phys: byte workloads' GB/s over the physical limit in the same direction (PUT:
    client to server; GET and mixed: server to client) for the same object size and client
    count. That limit is the best GB/s the raw peer reached in that direction, streaming,
    sequential or pipelined, over every time it was measured in this run (noise on a shared
    host only ever lowers a measurement, so the best is the estimate of the limit).
    ratio_phys_round (JSON only) uses the streams re-measured just before the cell's block.
    EXIST: requests/s over the raw peer's EXIST at the same depth and client count.
    ratio_raw_same: the raw peer running the identical op/depth/size/clients.
    ratio_redis: redis (redis-local, else any redis:// target) on the same cell.
    ratio_store: PUT and GET cells over the store limit (target ``store``: the raw peer
    writing each object into, and sending each GET reply from, the next of many cold
    buffers) on the same cell.
    Byte workloads compare GB/s (GET bytes count hits only), EXIST compares requests/s.
    """
    phys = {_key(c): c for c in cells if c["target"] == "phys" and c.get("round", "phys") == "phys"}
    redis_targets = [t for t in dict.fromkeys(c["target"] for c in cells) if t in REDIS_NAMES]
    redis_targets += [
        t
        for t in dict.fromkeys(c["target"] for c in cells)
        if t.startswith("redis://") and t not in redis_targets
    ]
    redis = {_key(c): c for c in cells if redis_targets and c["target"] == redis_targets[0]}
    store = {_key(c): c for c in cells if c["target"] == "store"}
    limit: dict[tuple[str, str, int, int], float] = {}
    for c in cells:
        if c["target"] == "phys" and c["op"] != "mixed" and c.get("gbps"):
            direction = "put" if "put" in c["op"] else "get"
            for rnd in (c.get("round", "phys"), "*"):
                k = (rnd, direction, c["size"], c["clients"])
                limit[k] = max(limit.get(k, 0.0), c["gbps"])
    for c in cells:
        op, depth, size, clients = _key(c)
        if op in BYTE_OPS:
            direction = "put" if "put" in op else "get"
            c["phys_limit_gbps"] = limit.get(("*", direction, size, clients))
            c["ratio_phys"] = _ratio(c["gbps"], c["phys_limit_gbps"])
            if c["target"] != "phys":
                c["phys_limit_round_gbps"] = limit.get((c.get("round", "phys"), direction, size, clients))
                c["ratio_phys_round"] = _ratio(c["gbps"], c["phys_limit_round_gbps"])
        else:
            ref = phys.get((op, depth, size, clients))
            c["ratio_phys"] = _ratio(c["ops_per_s"], ref["ops_per_s"] if ref else None)
        # Byte workloads compare GB/s (GET bytes count hits only); EXIST compares requests/s.
        fig = "gbps" if op in BYTE_OPS else "ops_per_s"
        same = phys.get(_key(c))
        c["ratio_raw_same"] = _ratio(c[fig], same[fig] if same else None)
        r = redis.get(_key(c))
        c["ratio_redis"] = _ratio(c[fig], r[fig] if r else None)
        c["redis_target"] = redis_targets[0] if r else None
        s = store.get(_key(c)) if c["target"] not in ("phys", "store") else None
        c["ratio_store"] = _ratio(c[fig], s[fig] if s else None)


def _f(v: float | None, nd: int = 2) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:.{nd}f}"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def detail_table(cells: list[dict[str, Any]]) -> str:
    head = (
        "| target | workload | size | clients | GB/s | kops/s | p50 µs | p99 µs | p99.9 µs "
        "| srv CPU s/GB | srv CPU µs/op | xphys | xraw same op | xredis | miss/fail | round | notes |"
    )
    rows = [head, "|" + "---|" * 17]
    for c in cells:
        lat = c.get("lat_us") or {}
        kops = c["ops_per_s"] / 1e3 if c.get("ops_per_s") else None
        miss = c["ops"] - c.get("hits", 0) if c["ops"] else 0
        notes = "; ".join(e.splitlines()[-1][:80] for e in c.get("client_errors") or [])
        rows.append(
            f"| {c['target']} | {op_label(c['op'], c['depth'])} | {fmt_size(c['size'])} | {c['clients']} "
            f"| {_f(c['gbps'])} | {_f(kops, 1)} | {_f(lat.get('p50'), 0)} | {_f(lat.get('p99'), 0)} "
            f"| {_f(lat.get('p999'), 0)} | {_f(c.get('cpu_s_per_gb'), 3)} | {_f(c.get('cpu_us_per_op'), 1)} "
            f"| {_x(c.get('ratio_phys'))} | {_x(c.get('ratio_raw_same'))} | {_x(c.get('ratio_redis'))} "
            f"| {miss} | {c.get('round', '')} | {notes} |"
        )
    return "\n".join(rows)


def side_by_side(cells: list[dict[str, Any]]) -> str:
    """One row per workload, one column per target: the figure that matters and its ratios."""
    cells = [c for c in cells if c.get("round", "phys") == "phys" or c["target"] != "phys"]
    targets = list(dict.fromkeys(c["target"] for c in cells))
    by = {(c["target"], *_key(c)): c for c in cells}
    workloads = list(dict.fromkeys(_key(c) for c in cells))
    head = "| workload | size | clients | " + " | ".join(targets) + " |"
    rows = [head, "|" + "---|" * (3 + len(targets))]
    for op, depth, size, clients in workloads:
        parts = []
        for t in targets:
            c = by.get((t, op, depth, size, clients))
            if c is None or c.get("ops_per_s") is None:
                parts.append("")
                continue
            val = f"{_f(c['gbps'])} GB/s" if op in BYTE_OPS else f"{_f(c['ops_per_s'] / 1000.0, 1)} kop/s"
            ratios = []
            if t != "phys" and c.get("ratio_phys") is not None:
                ratios.append(f"{c['ratio_phys']:.2f}xphys")
            if c.get("ratio_store") is not None:
                ratios.append(f"{c['ratio_store']:.2f}xstore")
            if c.get("ratio_redis") is not None and t != c.get("redis_target"):
                ratios.append(f"{c['ratio_redis']:.2f}xredis")
            if c["op"] in ("get", "exist", "mixed") and c["ops"] and c["hits"] < 0.99 * c["ops"]:
                ratios.append(f"{100 * (1 - c['hits'] / c['ops']):.0f}% miss")
            parts.append(val + (f" ({', '.join(ratios)})" if ratios else ""))
        rows.append(f"| {op_label(op, depth)} | {fmt_size(size)} | {clients} | " + " | ".join(parts) + " |")
    return "\n".join(rows)


def memory_table(memory: list[dict[str, Any]]) -> str:
    rows = ["| target | after size | stored MiB | server RSS MiB | RSS growth MiB | RSS per GB stored (GB) |"]
    rows.append("|---|---|---|---|---|---|")
    for m in memory:
        rows.append(
            f"| {m['target']} | {fmt_size(m['size'])} | {m['stored_bytes'] / 2**20:.0f} "
            f"| {_f(m['rss_bytes'] / 2**20 if m['rss_bytes'] is not None else None, 0)} "
            f"| {_f(m['rss_growth_bytes'] / 2**20 if m['rss_growth_bytes'] is not None else None, 0)} "
            f"| {_f(m.get('rss_per_gb_stored'), 2)} |"
        )
    return "\n".join(rows)


def disk_table(disk: list[dict[str, Any]]) -> str:
    rows = ["| object size | files | write+fsync GB/s | cold read GB/s |", "|---|---|---|---|"]
    for d in disk:
        rows.append(
            f"| {fmt_size(d['size'])} | {d['objects']} "
            f"| {_f(d['write_fsync_gbps'])} | {_f(d['read_cold_gbps'])} |"
        )
    return "\n".join(rows)


def render_markdown(doc: dict[str, Any]) -> str:
    meta = doc["meta"]
    parts = [
        f"# lmserver bench — {meta['started']}",
        "",
        f"Machine: {meta['cpus']} CPUs, {meta['mem_gib']:.0f} GiB RAM, Python {meta['python']}; "
        f"mode: {'smoke' if meta['smoke'] else 'full'}; {meta['duration_s']} s per cell; "
        f"pipeline depth {meta['depth']}; run took {meta.get('elapsed_s', 0):.0f} s; "
        f"1-min load average at start/end: {meta.get('loadavg_1m_start_end')} (other work on the host "
        "skews every figure; the loopback limit is re-measured before each target's size block).",
        "",
        "## Targets",
        "",
    ]
    for t in doc["targets"]:
        parts.append(
            f"- **{t['name']}** {t.get('address') or ''} {('— ' + t['note']) if t.get('note') else ''}"
        )
    for n in doc["notes"]:
        parts.append(f"- note: {n}")
    parts += ["", "## Side by side", "", side_by_side(doc["cells"]), ""]
    if doc["disk_limit"]:
        parts += [
            "## Disk limit (raw files in the disk tier's folder)",
            "",
            disk_table(doc["disk_limit"]),
            "",
        ]
    if doc["memory"]:
        parts += ["## Server memory", "", memory_table(doc["memory"]), ""]
    parts += ["## All cells", "", detail_table(doc["cells"]), ""]
    return "\n".join(parts)


def write_json(doc: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(doc, indent=1, default=str) + "\n")


# ---------------------------------------------------------------------------------------
# plots


def _style(target: str) -> dict[str, Any]:
    palette = {"lmserver": "tab:blue", "lmserver+disk": "tab:cyan", "redis-local": "tab:red"}
    return {"color": palette.get(target), "marker": "o", "linewidth": 1.6, "markersize": 4}


def plot_all(doc: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = doc["cells"]
    files = []
    targets = [t for t in dict.fromkeys(c["target"] for c in cells) if t != "phys"]
    sizes = sorted({c["size"] for c in cells})
    clients = sorted({c["clients"] for c in cells})
    depth = doc["meta"]["depth"]
    limit: dict[tuple[str, int, int], float] = {}
    for c in cells:
        if c["target"] == "phys" and c["op"] != "mixed" and c.get("gbps"):
            k = ("put" if "put" in c["op"] else "get", c["size"], c["clients"])
            limit[k] = max(limit.get(k, 0.0), c["gbps"])
    cells = [c for c in cells if c.get("round", "phys") == "phys" or c["target"] != "phys"]
    by = {(c["target"], *_key(c)): c for c in cells}
    disk = {d["size"]: d for d in doc["disk_limit"]}

    # 1. Throughput vs object size, per workload and client count, physical limit drawn in.
    rows = [("put", 1), ("put", depth), ("get", 1), ("get", depth), ("mixed", 1)]
    fig, axes = plt.subplots(
        len(rows), len(clients), figsize=(4.6 * len(clients), 3.2 * len(rows)), squeeze=False
    )
    for i, (op, d) in enumerate(rows):
        direction = "put" if op == "put" else "get"
        for j, n in enumerate(clients):
            ax = axes[i][j]
            ys = [limit.get((direction, s, n)) for s in sizes]
            if any(y is not None for y in ys):
                ax.plot(sizes, ys, "k--", linewidth=2, label="physical limit (loopback, best raw)")
            same = [by.get(("phys", op, d, s, n)) for s in sizes]
            ys = [c["gbps"] if c else None for c in same]
            if any(y is not None for y in ys):
                ax.plot(sizes, ys, color="grey", linestyle=":", label="raw server, same workload")
            if disk and op in ("put", "get"):
                k = "write_fsync_gbps" if op == "put" else "read_cold_gbps"
                ys = [disk[s][k] if s in disk else None for s in sizes]
                ax.plot(sizes, ys, color="tab:brown", linestyle="-.", label=f"disk {k.split('_gbps')[0]}")
            for t in targets:
                ys = [by[(t, op, d, s, n)]["gbps"] if (t, op, d, s, n) in by else None for s in sizes]
                if any(y is not None for y in ys):
                    ax.plot(sizes, ys, label=t, **_style(t))
            ax.set_xscale("log", base=2)
            ax.set_xticks(sizes, [fmt_size(s).replace(" ", "") for s in sizes])
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
            ax.set_title(f"{op_label(op, d)}, {n} client{'s' if n > 1 else ''}", fontsize=10)
            if j == 0:
                ax.set_ylabel("GB/s")
            if i == len(rows) - 1:
                ax.set_xlabel("object size")
    handles, labels = {}, {}
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(lab, h)
            labels[lab] = lab
    fig.legend(list(handles.values()), list(labels), loc="upper center", ncol=4, fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    p = out / "throughput.png"
    fig.savefig(p, dpi=80)
    plt.close(fig)
    files.append(p)

    # 2. Latency CDFs at one reference size, one client.
    ref = 4 << 20 if 4 << 20 in sizes else sizes[-1]
    n0 = clients[0]
    lrows = [("put", 1), ("get", 1), ("exist", 1), ("exist", depth), ("mixed", 1), ("get", depth)]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8), squeeze=False)
    for ax, (op, d) in zip(axes.flat, lrows, strict=True):
        for t in ["phys", *targets]:
            c = by.get((t, op, d, ref, n0))
            if not c or not c.get("cdf_us"):
                continue
            kw = {"color": "k", "linestyle": "--"} if t == "phys" else _style(t) | {"marker": None}
            ax.plot(c["cdf_us"], CDF_QUANTILES, label="raw server" if t == "phys" else t, **kw)
        ax.set_xscale("log")
        ax.set_ylim(0, 1.0)
        ax.grid(alpha=0.3)
        unit = "per batch" if d > 1 else "per request"
        ax.set_title(f"{op_label(op, d)}, {fmt_size(ref)}, {n0} client ({unit})", fontsize=10)
        ax.set_xlabel("latency µs")
        ax.set_ylabel("fraction ≤ x")
        ax.legend(fontsize=8)
    fig.tight_layout()
    p = out / "latency_cdf.png"
    fig.savefig(p, dpi=80)
    plt.close(fig)
    files.append(p)

    # 3. EXIST request rate.
    fig, ax = plt.subplots(figsize=(10, 4))
    groups = [(d, n) for d in (1, depth) for n in clients]
    allt = ["phys", *targets]
    width = 0.8 / max(1, len(allt))
    small = sizes[0]
    for k, t in enumerate(allt):
        ys = [(by.get((t, "exist", d, small, n)) or {}).get("ops_per_s") or 0 for d, n in groups]
        xs = [g + k * width for g in range(len(groups))]
        color = "k" if t == "phys" else _style(t)["color"]
        ax.bar(xs, [y / 1e3 for y in ys], width, label="raw server" if t == "phys" else t, color=color)
    ax.set_xticks(
        [g + width * (len(allt) - 1) / 2 for g in range(len(groups))],
        [f"{'seq' if d == 1 else f'pipe{d}'} x{n}" for d, n in groups],
    )
    ax.set_ylabel("EXIST kreq/s")
    ax.set_title("EXIST rate (sequential and pipelined, by client count)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    p = out / "exist.png"
    fig.savefig(p, dpi=80)
    plt.close(fig)
    files.append(p)
    return files
