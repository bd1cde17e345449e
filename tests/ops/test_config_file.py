"""--config: every serve option can come from a TOML file, below the environment and the CLI."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
import pytest
from click.core import ParameterSource
from click.testing import CliRunner

import lmserver.server
from lmserver.cli import Size, main, serve
from lmserver.config import ServerConfig
from lmserver.configfile import NOT_IN_FILE


@pytest.fixture(autouse=True)
def no_lmserver_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("LMSERVER_"):
            monkeypatch.delenv(name)


def sample(option: click.Option, tmp_path: Path) -> tuple[Any, Any]:
    """A value for ``option`` that differs from its default: (TOML value, what click makes of it)."""
    kind = option.type
    if option.multiple:
        return ["10.1.0.0/16", "192.168.7.7"], ("10.1.0.0/16", "192.168.7.7")
    if option.is_flag:
        return (not option.default), (not option.default)
    if isinstance(kind, click.Choice):
        choice = next(c for c in kind.choices if c != option.default)
        return choice, choice
    if isinstance(kind, click.types.IntParamType):
        low = getattr(kind, "min", None) or 0
        return low + 7, low + 7
    if isinstance(kind, click.types.FloatParamType):
        return 1.5, 1.5
    if isinstance(kind, Size):
        return "3MiB", 3 * 1024**2
    if isinstance(kind, click.Path):
        path = tmp_path / f"{option.name}.file"
        if kind.file_okay:
            path.write_text("x")
        return str(path), path
    if isinstance(kind, click.types.StringParamType):
        return "127.0.0.9", "127.0.0.9"
    pytest.fail(f"no sample value for option {option.name} of type {kind!r}: add one here")


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(map(toml_value, value)) + "]"
    return repr(value)


def file_options() -> list[click.Option]:
    return [p for p in serve.params if isinstance(p, click.Option) and p.name not in NOT_IN_FILE]


@pytest.mark.parametrize("spelling", ["dashes", "underscores"])
def test_a_config_file_sets_every_option(tmp_path: Path, spelling: str) -> None:
    lines, expected = [], {}
    for option in file_options():
        toml, value = sample(option, tmp_path)
        key = next(o for o in option.opts if o.startswith("--"))[2:]
        if spelling == "underscores":
            key = key.replace("-", "_")
        lines.append(f"{key} = {toml_value(toml)}")
        expected[option.name] = value
    config = tmp_path / "lmserver.toml"
    config.write_text("\n".join(lines) + "\n")

    ctx = serve.make_context("serve", ["--config", str(config)])

    for name, value in expected.items():
        assert ctx.params[name] == value, name
        assert ctx.get_parameter_source(name) == ParameterSource.DEFAULT_MAP, name


def test_precedence_is_cli_then_env_then_file_then_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "c.toml"
    config.write_text('port = 7000\nmax-connections = 77\nlog-level = "debug"\n')
    monkeypatch.setenv("LMSERVER_PORT", "7001")
    monkeypatch.setenv("LMSERVER_LOG_LEVEL", "error")

    ctx = serve.make_context("serve", ["--config", str(config), "--log-level", "warning"])

    assert ctx.params["log_level"] == "warning"  # CLI over env and file
    assert ctx.params["port"] == 7001  # env over file
    assert ctx.params["max_connections"] == 77  # file over default
    assert ctx.params["shutdown_timeout"] == 10.0  # default


def test_the_config_path_can_come_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "c.toml"
    config.write_text("max_list_keys = 5\n")
    monkeypatch.setenv("LMSERVER_CONFIG", str(config))
    ctx = serve.make_context("serve", [])
    assert ctx.params["max_list_keys"] == 5


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("bogus = 1\n", "unknown option 'bogus'"),
        ('port = "7000"\n', "expected an integer"),
        ("port = true\n", "not a TOML bool"),
        ("shutdown-timeout = [1]\n", "not a TOML list"),
        ("plain = 1\n", "expected true or false"),
        ("port = 1\nport ==\n", "not valid TOML"),
        ("port = 1\n[section]\nx = 1\n", "unknown option 'section'"),
        ("memory-limit = 5\nmemory_limit = 6\n", "set twice"),
        ("port = 70000\n", "70000 is not in the range"),
        ('memory-limit = "lots"\n', "not a size"),
        ('allow = ["10.0.0.0/8", 5]\n', "expected a string"),
    ],
)
def test_a_bad_config_file_is_a_clear_error(tmp_path: Path, content: str, message: str) -> None:
    config = tmp_path / "bad.toml"
    config.write_text(content)
    result = CliRunner().invoke(main, ["--config", str(config)])
    assert result.exit_code == 2
    assert message in result.output


def test_the_server_runs_with_the_file_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "c.toml"
    config.write_text('max-connections = 12\nmemory-limit = "64MiB"\nallow = "127.0.0.0/8, ::1"\n')
    seen: list[ServerConfig] = []
    monkeypatch.setattr(lmserver.server, "run", lambda cfg, describe: seen.append(cfg) or 0)

    result = CliRunner().invoke(main, ["--config", str(config), "--port", "0"])

    assert result.exit_code == 0, result.output
    assert seen[0].max_connections == 12
    assert seen[0].memory_limit == 64 * 1024**2
    assert seen[0].allow == ("127.0.0.0/8, ::1",)


def test_lmserver_allow_takes_spaces_and_commas(monkeypatch: pytest.MonkeyPatch) -> None:
    from lmserver.access import AccessList

    monkeypatch.setenv("LMSERVER_ALLOW", "10.0.0.0/8,127.0.0.1  ::1")
    ctx = serve.make_context("serve", [])
    allowed = AccessList(ctx.params["allow"])
    assert [str(n) for n in allowed.networks] == ["10.0.0.0/8", "127.0.0.1/32", "::1/128"]


def test_the_documented_example_is_a_valid_config_file(tmp_path: Path) -> None:
    from lmserver.configfile import load_default_map

    manual = (Path(__file__).parents[2] / "docs" / "operating.md").read_text()
    section = manual.split("## Configuration file", 1)[1]
    example = section.split("```toml\n", 1)[1].split("```", 1)[0]
    config = tmp_path / "example.toml"
    config.write_text(example)
    defaults = load_default_map(config, serve)  # keys and kinds; paths need not exist here
    assert defaults["memory_limit"] == "16GiB" and defaults["allow"] == ["10.0.0.0/8", "192.168.1.20"]
