"""Config fields as command-line options: the ``cli`` metadata a field declares its option with, and the argv back.

A dataclass field with ``cli`` metadata is an option of the command built from that dataclass
(``peer/config_options.py``'s ``field_options``): flag ``--field-name`` unless it names one, its help, its least
value. ``config_argv`` goes the other way: the options that recreate a config from its class's defaults, so a
launcher writes ``swarmloco run`` argv from a ``PeerConfig`` instead of spelling flags by hand.

    >>> steps: int = field(default=100, metadata=cli("Trainers: inner steps of stage 0 to run.", min=1))
    >>> config_argv(PeerConfig(role="stage", stage=2))  # ['--role', 'stage', '--stage', '2']
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from _typeshed import DataclassInstance


def cli(
    help: str,
    *,
    flag: str | None = None,
    aliases: tuple[str, ...] = (),
    min: float | None = None,
    as_text: bool = False,
) -> dict[str, object]:
    """A config field's command-line option, as the field's metadata: its ``--help`` text, its flag (default
    ``--field-name``) and other names (e.g. ``-k``), the least value typer accepts, and ``as_text`` for a field the
    command line gives as text that the config parses (its ``str`` is that text)."""
    limits = {} if min is None else {"min": min}
    return {"cli": {"help": help, "flag": flag, "aliases": aliases, "limits": limits, "as_text": as_text}}


def cli_spec(f: dataclasses.Field[Any]) -> Mapping[str, Any] | None:
    """The field's ``cli`` metadata; None: the field is no command-line option."""
    spec: Mapping[str, Any] | None = f.metadata.get("cli")
    return spec


def cli_flag(f: dataclasses.Field[Any]) -> str | None:
    """The field's option (``--field-name`` unless its metadata names another); None: it has none."""
    if (spec := cli_spec(f)) is None:
        return None
    flag: str = spec["flag"] or "--" + f.name.replace("_", "-")
    return flag


def negated(flag: str) -> str:
    """The option that turns a boolean field off: ``--serve`` → ``--no-serve``."""
    return "--no-" + flag.removeprefix("--")


def config_argv(config: DataclassInstance, *, default: DataclassInstance | None = None, prefix: str = "") -> list[str]:
    """The options that recreate ``config`` from ``default`` (its class's defaults): one per field that differs, in
    field order, nested dataclasses without an option of their own walked into. A differing field no option can
    express (no ``cli`` metadata, a list emptied, a value set back to None) is a ValueError naming it."""
    default = type(config)() if default is None else default
    argv: list[str] = []
    for f in dataclasses.fields(config):
        value, base = getattr(config, f.name), getattr(default, f.name)
        if value == base:
            continue
        if (flag := cli_flag(f)) is not None:
            argv += _option(flag, value, prefix + f.name)
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            argv += config_argv(value, default=base, prefix=f"{prefix}{f.name}.")
        else:
            raise ValueError(f"{prefix}{f.name} = {value!r}: no command-line option sets it")
    return argv


def _option(flag: str, value: object, name: str) -> list[str]:
    """``flag`` giving ``value`` as typer reads it back: a boolean as the flag or its ``--no-`` form, a list as the flag
    repeated, a float in its exact shortest form."""
    if isinstance(value, bool):
        return [flag if value else negated(flag)]
    if isinstance(value, list | tuple):
        if not value:
            raise ValueError(f"{name}: an empty list cannot be given on the command line")
        return [text for item in value for text in (flag, _text(item))]
    if value is None:
        raise ValueError(f"{name}: None cannot be given on the command line")
    return [flag, _text(value)]


def _text(value: object) -> str:
    return repr(value) if isinstance(value, float) else str(value)
