"""Each training option is declared once, as a field of :class:`~scalefold.config.training.TrainConfig`
with :func:`option` metadata (help, command-line flag, Slurm config variable); everything else derives
from that declaration:

* the ``scalefold train`` flags (:func:`add_arguments`, :func:`overrides_from_args`);
* the ``SCALEFOLD_<OPTION>`` environment overrides and the Slurm config variable map
  (:func:`slurm_config_env`, used by :meth:`TrainConfig.with_env`);
* the flags ``launch/run_and_time.sh`` passes for a ``config_*.sh`` environment
  (``scalefold slurm-flags``, one argument a line; :func:`slurm_flags`).

Standard library only: ``run_and_time.sh`` runs it with whatever ``python3`` the node has.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any

ENV_PREFIX = "SCALEFOLD_"
_TRUE = ("1", "true", "yes", "on")


def option(default: Any = dataclasses.MISSING, *, help: str = "", flag: str | None = None, cli: bool = False,
           slurm: str | None = None, slurm_omit_default: bool = False, choices: Sequence[Any] | None = None,
           default_factory: Any = dataclasses.MISSING) -> Any:  # fmt: skip
    """A :class:`TrainConfig` field with its declaration.

    ``cli``: a ``scalefold train`` flag exists (``--name-with-dashes``, or ``flag``); ``slurm``: the
    ``config_*.sh`` variable that sets it (read when ``DGXSYSTEM`` is set, and passed on as the flag by
    ``run_and_time.sh``; with ``slurm_omit_default`` only when it differs from the default, so a plain
    data-parallel run needs no layout flags); ``choices``: the values the flag accepts.
    """
    meta = {"help": help, "cli": cli or flag is not None, "flag": flag, "slurm": slurm,
            "slurm_omit_default": slurm_omit_default, "choices": tuple(choices) if choices else None}  # fmt: skip
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _options(cls: type) -> list[dataclasses.Field]:
    return list(dataclasses.fields(cls))


def flag_of(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def _value_type(f: dataclasses.Field, cls: type) -> type:
    """``int`` / ``float`` / ``str`` / ``bool`` / ``tuple`` of a field (``X | None`` -> ``X``)."""
    hint = typing.get_type_hints(cls)[f.name]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return typing.get_origin(hint) or hint


# -- command line ----------------------------------------------------------------------------------


def add_arguments(parser: Any, cls: type) -> None:
    """One flag per option declared with ``cli`` on ``parser`` (an ``argparse`` parser of :mod:`scalefold.commands`):
    default ``None`` (= not given: lower layers decide)."""
    for f in _options(cls):
        if not f.metadata.get("cli"):
            continue
        kind, flag, help_text = _value_type(f, cls), flag_of(f), f.metadata["help"]
        if kind is bool and flag.startswith("--no-"):  # a switch that turns a default-on option off
            parser.add_argument(flag, dest=f.name, action="store_false", default=None, help=help_text)
        elif kind is bool:
            parser.add_argument(flag, dest=f.name, action="store_true", default=None, help=help_text)
        else:
            parser.add_argument(flag, dest=f.name, type=kind, choices=f.metadata["choices"], help=help_text)


def overrides_from_args(args: Any, cls: type) -> dict[str, Any]:
    """The options given on the command line (``args``: the parsed namespace; ``None``: not given)."""
    return {f.name: getattr(args, f.name) for f in _options(cls) if f.metadata.get("cli")}


# -- environment -----------------------------------------------------------------------------------


def slurm_config_env(cls: type) -> dict[str, str]:
    """``config_*.sh`` variable -> option name."""
    return {f.metadata["slurm"]: f.name for f in _options(cls) if f.metadata.get("slurm")}


def parse_value(raw: str, current: Any, name: str, var: str, kind: type) -> Any:
    """``raw`` (an environment value) converted to the option's type; errors name ``var``."""
    raw = raw.strip()
    try:
        if kind is bool:
            if raw.lower() in _TRUE:
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError("not a boolean (1/0, true/false, yes/no, on/off)")
        if current is None and raw.lower() in ("", "none"):  # an optional value left unset
            return None
        if kind is tuple:
            return tuple(int(x) for x in raw.split(","))
        return kind(raw)
    except ValueError as exc:
        raise ValueError(f"environment variable {var}={raw!r} is not valid for option {name!r}: {exc}") from None


def env_value_type(cls: type, name: str) -> type:
    return _value_type(next(f for f in _options(cls) if f.name == name), cls)


def slurm_flags(env: Mapping[str, str], cls: type, skip: Sequence[str] = ("preset",)) -> list[str]:
    """The ``scalefold train`` arguments for the options a ``config_*.sh`` environment sets (empty
    values ignored; ``slurm_omit_default`` options only when they differ from the default; switches
    only when true). ``skip``: options the launch script passes itself."""
    args: list[str] = []
    for f in _options(cls):
        var = f.metadata.get("slurm")
        raw = env.get(var, "") if var else ""
        if not raw or f.name in skip or not f.metadata.get("cli"):
            continue
        kind = _value_type(f, cls)
        value = parse_value(raw, f.default, f.name, var, kind)
        if kind is bool:
            args += [flag_of(f)] if value else []
        elif not (f.metadata["slurm_omit_default"] and value == f.default):
            args += [flag_of(f), raw.strip()]
    return args


__all__ = [
    "ENV_PREFIX", "add_arguments", "env_value_type", "flag_of", "option", "overrides_from_args", "parse_value",
    "slurm_config_env", "slurm_flags",
]  # fmt: skip
