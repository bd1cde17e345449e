"""Every option's range is checked at startup: a bad value is one clear error, exit 2."""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import click
import pytest
from click.testing import CliRunner

from lmserver.cli import main, serve
from lmserver.config import CHOICES, ServerConfig, default, option
from lmserver.storage.tiers.disk import DEFAULT_CAPACITY, FSYNC_POLICIES

# (option, a bad value, a word the error must contain)
BAD_CLI = [
    ("--port", "65536", "65536"),
    ("--port", "-1", "-1"),
    ("--memory-limit", "0", "--memory-limit"),
    ("--memory-limit", "lots", "not a size"),
    ("--max-object-size", "0", "--max-object-size"),
    ("--max-object-size", "2GiB", "--max-object-size"),
    ("--disk-limit", "0", "--disk-limit"),
    ("--fsync", "sometimes", "sometimes"),
    ("--disk-direct", "always", "always"),
    ("--write-behind-limit", "-1", "not a size"),
    ("--memory-wait", "-1", "-1"),
    ("--memory-wait", "nan", "--memory-wait"),
    ("--memory-wait", "inf", "--memory-wait"),
    ("--max-connections", "0", "0"),
    ("--max-list-keys", "0", "0"),
    ("--max-connections-per-address", "0", "0"),
    ("--idle-timeout", "-1", "-1"),
    ("--header-timeout", "inf", "--header-timeout"),
    ("--body-timeout", "nan", "--body-timeout"),
    ("--shutdown-timeout", "-0.5", "-0.5"),
    ("--shutdown-timeout", "inf", "--shutdown-timeout"),
    ("--protocol", "v2", "v2"),
    ("--loop", "trio", "trio"),
    ("--log-level", "loud", "loud"),
    ("--log-format", "xml", "xml"),
]


@pytest.mark.parametrize(("option", "value", "word"), BAD_CLI)
def test_bad_option_value_is_a_one_line_usage_error(
    option: str, value: str, word: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Were a bad value accepted, the command must not serve forever: it exits 3 instead.
    monkeypatch.setattr("lmserver.server.run", lambda config, describe: 3)
    result = CliRunner().invoke(main, ["serve", "--memory-limit", "1GiB", option, value])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and word in errors[0], result.output


BAD_CONFIG: list[dict[str, Any]] = [
    {"host": ""},
    {"port": 70000},
    {"protocol": "v2"},
    {"memory_limit": 0},
    {"max_object_size": 0},
    {"max_object_size": 2**31},
    {"disk_limit": 0},
    {"fsync": "sometimes"},
    {"disk_direct": "on"},
    {"write_behind_limit": -1},
    {"max_connections": 0},
    {"max_connections": 2**20 + 1},
    {"max_connections_per_address": 2**20 + 1},
    {"memory_limit": 2**60 + 1},
    {"disk_limit": 10**30},
    {"write_behind_limit": 2**61},
    {"max_list_keys": 2**31},
    {"idle_timeout": 1e300},
    {"max_list_keys": 0},
    {"max_connections_per_address": 0},
    {"idle_timeout": -1.0},
    {"header_timeout": math.inf},
    {"body_timeout": math.nan},
    {"memory_wait": -1.0},
    {"memory_wait": math.nan},
    {"shutdown_timeout": math.inf},
    {"loop": "trio"},
    {"log_level": "loud"},
    {"log_format": "xml"},
]


@pytest.mark.parametrize("bad", BAD_CONFIG, ids=lambda bad: "-".join(f"{k}={v}" for k, v in bad.items()))
def test_config_rejects_out_of_range_values(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="--"):
        ServerConfig(**{"memory_limit": 2**30, **bad})


def test_config_accepts_the_bounds() -> None:
    low = ServerConfig(
        port=0,
        memory_limit=1,
        max_object_size=1,
        disk_limit=1,
        write_behind_limit=0,  # a queue that holds nothing: every write-behind is skipped
        max_connections=1,
        max_list_keys=1,
        memory_wait=0.0,
        shutdown_timeout=0.0,
    )
    assert low.max_object_size == 1
    high = ServerConfig(port=65535, memory_limit=2**40, max_object_size=2**31 - 1)
    assert high.max_object_size == 2**31 - 1
    # A larger object limit than memory is clamped to memory, as before.
    assert ServerConfig(memory_limit=1024, max_object_size=4096).max_object_size == 1024


def test_each_setting_has_one_name_and_its_default_and_choices_come_from_the_config(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One name per setting (field, option, variable, config-file key) and one place for its
    default and choices: ServerConfig (config.py), which the serve options read."""
    for name in list(os.environ):
        if name.startswith("LMSERVER_"):
            monkeypatch.delenv(name)
    options = {p.name: p for p in serve.params if isinstance(p, click.Option) and p.name != "config"}
    assert set(options) == {f.name for f in dataclasses.fields(ServerConfig)}
    params = serve.make_context("serve", []).params  # every option at its default, converted
    for name, opt in options.items():
        long = "--tier" if name == "tiers" else option(name)
        assert long in opt.opts, (name, opt.opts)
        assert opt.envvar == "LMSERVER_" + long.removeprefix("--").replace("-", "_").upper()
        assert params[name] == default(name), name
        if name in CHOICES:
            assert isinstance(opt.type, click.Choice) and tuple(opt.type.choices) == CHOICES[name]
    assert CHOICES["fsync"] == FSYNC_POLICIES and default("disk_limit") == DEFAULT_CAPACITY
