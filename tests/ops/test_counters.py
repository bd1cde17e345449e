"""lmserver/counters.py declares every server counter, and the declarations hang together."""

from __future__ import annotations

import ast
import re
from collections import Counter as Tally
from pathlib import Path

from lmproto import Command
from lmserver import counters
from lmserver.counters import COUNTER, COUNTERS, FAMILIES, MEMBERS, family_samples, refusals, stats_field

LMSERVER = Path(counters.__file__).parent


def _pattern(node: ast.JoinedStr) -> re.Pattern[str]:
    parts = [re.escape(v.value) if isinstance(v, ast.Constant) else ".+" for v in node.values]
    return re.compile("".join(parts))


def _counted_names() -> tuple[set[str], list[tuple[str, re.Pattern[str]]]]:
    """Counter names lmserver's server modules count: ``counters[<literal>]``, an f-string
    key, a ``counter=`` argument or default, ``_time_out(<name>, ...)``, and the reasons
    admission.py turns into ``connections_refused_<reason>``, and the sweep's verdicts (``IDLE``
    and the keys of ``REASONS`` in connection/sweep.py)."""
    names: set[str] = set()
    patterns: list[tuple[str, re.Pattern[str]]] = []
    for path in sorted([*LMSERVER.glob("*.py"), *(LMSERVER / "connection").glob("*.py")]):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Subscript) and (
                (isinstance(node.value, ast.Attribute) and node.value.attr == "counters")
                or (isinstance(node.value, ast.Name) and node.value.id == "counters")
            ):
                key = node.slice
                if isinstance(key, ast.Constant) and isinstance(key.value, str):
                    names.add(key.value)
                elif isinstance(key, ast.JoinedStr):
                    patterns.append((f"{path.name}:{node.lineno}", _pattern(key)))
            elif isinstance(node, ast.Call):
                func = node.func
                called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                args = [*node.args[:1]] if called == "_time_out" else []
                if path.name == "admission.py" and called == "_refuse":
                    reasons = [a.value for a in node.args[:1] if isinstance(a, ast.Constant)]
                    args = [ast.Constant(f"connections_refused_{reason}") for reason in reasons]
                args += [k.value for k in node.keywords if k.arg == "counter"]
                names.update(
                    a.value for a in args if isinstance(a, ast.Constant) and isinstance(a.value, str)
                )
            elif isinstance(node, ast.FunctionDef):
                positional = node.args.args[len(node.args.args) - len(node.args.defaults) :]
                pairs = [
                    *zip(positional, node.args.defaults, strict=True),
                    *zip(node.args.kwonlyargs, node.args.kw_defaults, strict=True),
                ]
                names.update(
                    default.value
                    for arg, default in pairs
                    if arg.arg == "counter"
                    and isinstance(default, ast.Constant)
                    and isinstance(default.value, str)
                )
            elif path.name == "sweep.py" and isinstance(node, ast.AnnAssign):
                # The sweep's verdicts: IDLE and the keys of REASONS are the counters it bumps.
                target = getattr(node.target, "id", None)
                if target == "IDLE" and isinstance(node.value, ast.Constant):
                    names.add(node.value.value)
                elif target == "REASONS" and isinstance(node.value, ast.Dict):
                    names.update(k.value for k in node.value.keys if isinstance(k, ast.Constant))
            elif path.name == "admission.py" and isinstance(node, ast.Assign):
                target = [getattr(t, "id", None) for t in node.targets]
                if target == ["reason"] and isinstance(node.value, ast.Constant):
                    names.add(f"connections_refused_{node.value.value}")
    return names, patterns


def test_every_counted_name_is_declared() -> None:
    names, patterns = _counted_names()
    assert {
        "connections_accepted",
        "refused",
        "refused_no_space",
        "send_timeouts",
        "metrics_scrapes",
    } <= names
    assert {"connections_refused_max", "connections_refused_not_allowed"} <= names
    assert sorted(names - COUNTER.keys()) == []
    for where, pattern in patterns:
        assert any(pattern.fullmatch(name) for name in COUNTER), (
            f"{where}: {pattern.pattern} matches no counter"
        )
    # ... and nothing is declared that the server never counts.
    assert [n for n in COUNTER.keys() - names if not any(p.fullmatch(n) for _, p in patterns)] == []


def test_declarations_hang_together() -> None:
    assert [name for name, n in Tally(c.name for c in COUNTERS).items() if n > 1] == []
    family_names = {family.name for family in FAMILIES}
    assert {c.family for c in COUNTERS if c.family is not None} <= family_names
    for family in FAMILIES:
        labels = [c.label for c in MEMBERS[family.name]]
        assert len(set(labels)) == len(labels), family.name
        if family.label is None:
            assert labels == [None], family.name  # one sample
        else:
            assert None not in labels and set(family.always) <= set(labels), family.name
        if family.other_from is not None:
            assert family.other_from in COUNTER and "other" not in labels
    paths = [c.stats for c in COUNTERS if c.stats is not None]
    assert len(set(paths)) == len(paths)
    assert {counters.command_refused(c) for c in Command} <= COUNTER.keys()
    assert not any(counters.command_refused(c) in counters.REFUSALS for c in Command)  # each refusal once


def test_stats_fields_and_families_from_counts() -> None:
    counted = {
        "gets_served": 3,
        "refused": 1,
        "refused_too_large": 2,
        "bad_requests": 4,
        "command_3_refused": 3,
    }
    counted |= {"connections_refused": 6, "connections_refused_max": 2, "put_waits_tier": 1}
    assert stats_field(counted, "hits") == 3 and stats_field(counted, "misses") == 0
    assert refusals(counted) == 7
    by_family = {family.name: family_samples(family, counted) for family in FAMILIES}
    assert by_family["lmserver_refusals"] == [("too_large", 2), ("other", 1)]
    assert by_family["lmserver_connections_refused"] == [("max", 2), ("other", 4)]
    assert by_family["lmserver_put_admission_waits"] == [("memory", 0), ("tier", 1)]
    assert by_family["lmserver_object_bytes"] == [("put", 0), ("get", 0)]
    assert by_family["lmserver_bad_requests"] == [(None, 4)]
