"""docs/grafana-dashboard.json queries only metrics the server exports."""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from serverthread import ServerThread

DASHBOARD = Path(__file__).parents[2] / "docs" / "grafana-dashboard.json"


def queries(node: Any) -> Iterator[str]:
    """Every PromQL text in the dashboard: panel targets and template variable queries."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("expr", "definition") and isinstance(value, str):
                yield value
            elif key == "query" and isinstance(value, str | dict):
                yield from ([value] if isinstance(value, str) else queries(value))
            else:
                yield from queries(value)
    elif isinstance(node, list):
        for item in node:
            yield from queries(item)


def test_every_queried_metric_is_exported(
    make_server_thread: Callable[..., ServerThread], tmp_path: Path
) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    used = {name for text in queries(dashboard) for name in re.findall(r"\blmserver_\w+", text)}
    assert len(used) >= 10  # the parse found the queries

    thread = make_server_thread(metrics_port=0, disk=tmp_path / "disk")
    with urllib.request.urlopen(f"http://127.0.0.1:{thread.metrics_port}/metrics", timeout=10) as response:
        exported = {
            sample.name
            for family in text_string_to_metric_families(response.read().decode())
            for sample in family.samples
        }
    assert used <= exported, sorted(used - exported)


def test_the_docs_point_at_the_dashboard() -> None:
    # The README's table of documents, and docs/metrics.md, which says what the panels show.
    assert "(docs/grafana-dashboard.json)" in (DASHBOARD.parents[1] / "README.md").read_text()
    assert "](grafana-dashboard.json)" in (DASHBOARD.parent / "metrics.md").read_text()
