"""``--config FILE``: serve options from a TOML file.

Strategy: the file becomes click's ``default_map``, which click consults after the command
line and the ``LMSERVER_*`` environment variables and before the built-in defaults: the
precedence CLI > environment > file > defaults that uvicorn and most servers use. Keys are
the long option names, with dashes or underscores (``memory-limit`` or ``memory_limit``).
Values keep their TOML types where those are unambiguous (numbers, booleans, lists) and are
converted and validated by the option itself, exactly as a command-line value would be, when
the file is read: an error names the file and the key, never the environment variable.
An error found later (``ServerConfig``'s checks, a startup failure) is described with the
file too, when the option at fault was set there (``describe``).
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource

from .config import OptionError

NOT_IN_FILE = frozenset({"config", "help"})
"""Options a config file cannot set."""

_FILE = "lmserver.config_file"
"""``ctx.meta`` key of the config file's path."""


def file_keys(command: click.Command) -> dict[str, click.Option]:
    """Every key a config file may use for ``command``, mapped to its option."""
    keys: dict[str, click.Option] = {}
    for param in command.params:
        if not isinstance(param, click.Option) or param.name in NOT_IN_FILE:
            continue
        for opt in param.opts:
            if opt.startswith("--"):
                keys[opt[2:]] = param
                keys[opt[2:].replace("-", "_")] = param
    return keys


def load_default_map(path: Path, command: click.Command, ctx: click.Context | None = None) -> dict[str, Any]:
    """The ``default_map`` for ``command`` from the TOML file at ``path``; a bad file, an
    unknown key or a value of the wrong kind or range raises ``click.BadParameter`` naming it."""
    try:
        with open(path, "rb") as file:
            data = tomllib.load(file)
    except OSError as exc:
        raise click.BadParameter(f"cannot read {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise click.BadParameter(f"{path} is not valid TOML: {exc}") from None
    keys = file_keys(command)
    defaults: dict[str, Any] = {}
    for key, value in data.items():
        option = keys.get(key)
        if option is None:
            known = ", ".join(sorted(k for k in keys if "_" not in k or k.replace("_", "-") not in keys))
            raise click.BadParameter(f"{path}: unknown option {key!r} (known: {known})")
        assert option.name is not None
        if option.name in defaults:
            raise click.BadParameter(f"{path}: {key!r} is set twice (dash and underscore spellings)")
        problem = _kind_problem(option, value)
        if problem is None and ctx is not None:
            problem = _conversion_problem(option, value, ctx)
        if problem is not None:
            raise click.BadParameter(f"{path}: {key} = {value!r}: {problem}")
        defaults[option.name] = [value] if option.multiple and isinstance(value, str) else value
    return defaults


def _kind_problem(option: click.Option, value: Any) -> str | None:
    """Why ``value`` cannot be meant for ``option`` (None if it can). Conversion and range
    checks are left to the option's type; this refuses what it would silently coerce."""
    if option.multiple:
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list):
            return "expected a string or a list of strings"
        return next((p for p in (_scalar_problem(option, item) for item in items) if p), None)
    return _scalar_problem(option, value)


def _scalar_problem(option: click.Option, value: Any) -> str | None:
    kind = option.type
    if option.is_flag or isinstance(kind, click.types.BoolParamType):
        return None if isinstance(value, bool) else "expected true or false"
    if isinstance(value, bool | list | dict):
        return f"expected one {kind.name} value, not a TOML {type(value).__name__}"
    if isinstance(kind, click.types.IntParamType):
        return None if isinstance(value, int) else "expected an integer"
    if isinstance(kind, click.types.FloatParamType):
        return None if isinstance(value, int | float) else "expected a number"
    if isinstance(kind, click.Choice | click.Path | click.types.StringParamType):
        return None if isinstance(value, str) else "expected a string"
    return None  # other types (sizes) take strings and numbers and check them themselves


def _conversion_problem(option: click.Option, value: Any, ctx: click.Context) -> str | None:
    """What the option's own type says of ``value`` (a range, a size, a path), or None."""
    try:
        option.type_cast_value(ctx, [value] if option.multiple and isinstance(value, str) else value)
    except click.BadParameter as exc:
        return exc.message
    return None


def use_config_file(ctx: click.Context, param: click.Parameter, value: Path | None) -> None:
    """Callback of the eager ``--config`` option: installs the file as ``default_map``."""
    if value is not None:
        try:
            defaults = load_default_map(value, ctx.command, ctx)
        except click.BadParameter as exc:  # its message names the file and the key already
            raise click.UsageError(exc.message, ctx) from None
        ctx.default_map = {**(ctx.default_map or {}), **defaults}
        ctx.meta[_FILE] = value


def describe(ctx: click.Context, exc: OptionError) -> str:
    """``exc``'s message, with the config file and key when the option was set there."""
    path = ctx.meta.get(_FILE)
    for param in ctx.command.params:
        if (
            exc.option in getattr(param, "opts", ())
            and param.name is not None
            and path is not None
            and ctx.get_parameter_source(param.name) == ParameterSource.DEFAULT_MAP
        ):
            return f"{exc} (set in {path}: {exc.option.removeprefix('--')})"
    return str(exc)
