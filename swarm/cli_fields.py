"""Config fields as command-line options: the ``cli`` metadata a field declares its option with, and the argv back.

A dataclass field with ``cli`` metadata is an option of the command built from that dataclass
(``peer/config_options.py``'s ``field_options``): flag ``--field-name`` unless it names one, its help, its least
value. ``config_argv`` goes the other way: the options that recreate a config from its class's defaults, so a
launcher writes ``swarmloco run`` argv from a ``PeerConfig`` instead of spelling flags by hand.
``add_field_arguments`` declares the same options on an ``argparse`` parser (the benchmark scripts') and
``from_arguments`` builds the config back from what it parsed, so a script's flag, help and default of a config field
are the field's.

    >>> steps: int = field(default=100, metadata=cli("Trainers: inner steps of stage 0 to run.", min=1))
    >>> config_argv(PeerConfig(role="stage", stage=2))  # ['--role', 'stage', '--stage', '2']
    >>> add_field_arguments(parser, LocalSwarm, "stages", "steps", defaults={"steps": 60})  # --stages, --steps
    >>> from_arguments(LocalSwarm, parser.parse_args(), peers=5)  # LocalSwarm(peers=5, stages=..., steps=...)
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from compress.config import cli as cli  # declared at the bottom of the layers: optim/ and compress/ use it too

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

C = TypeVar("C")  # a config dataclass


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


def add_field_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    root: type,
    *paths: str,
    defaults: Mapping[str, object] | None = None,
    flags: Mapping[str, tuple[str, ...]] | None = None,
) -> None:
    """One ``argparse`` option per field at dotted ``paths`` in ``root``'s dataclass tree, as its ``cli`` metadata
    declares it (flag and other names, help, least and greatest values): typed from the field (a ``Literal``'s values
    its choices, a boolean ``--x/--no-x``, a list the flag repeated), its default the field's own (a factory's: None,
    the config's) unless ``defaults`` gives the script's own (by path; None: left to the config), its names the
    field's unless ``flags`` gives the script's own (by path: e.g. ``{"outer.inner_steps": ("--h",)}``).
    ``args.<first long flag's name>`` holds it, as argparse names it (``--join-after``: ``join_after``)."""
    defaults, flags = defaults or {}, flags or {}
    for path in paths:
        section, f = field_at(root, path)
        if (spec := cli_spec(f)) is None or (flag := cli_flag(f)) is None:
            raise ValueError(f"{root.__name__}.{path} has no command-line option (no cli metadata)")
        names = flags.get(path, (flag, *spec["aliases"]))
        flag = next(name for name in names if name.startswith("--"))
        own = f.default if f.default is not dataclasses.MISSING else None
        default = defaults.get(path, own)
        shown = f"{default}" if default is not None else f"the config's, {own}" if own is not None else None
        text = spec["help"] + (f" (default: {shown})" if shown is not None else "")
        text = text.replace("\\[", "[").replace("%", "%%")  # typer's help escapes rich markup; argparse formats %
        option: dict[str, Any] = {"dest": _dest(flag), "default": default, "help": text}
        kind = typing.get_type_hints(section)[f.name]
        kind = _unwrap_optional(kind)
        if kind is bool:
            option["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(kind) is list:
            option |= {"action": "append", "type": _argument_type(typing.get_args(kind)[0], spec)}
        elif typing.get_origin(kind) is Literal:
            option["choices"] = typing.get_args(kind)
        else:
            option["type"] = _argument_type(kind, spec)
        parser.add_argument(*names, **option)


def argument_values(
    root: type, args: argparse.Namespace, *paths: str, flags: Mapping[str, tuple[str, ...]] | None = None
) -> dict[str, Any]:
    """{dotted path: value} of the options ``add_field_arguments`` declared for ``root``'s fields at ``paths`` (under
    ``flags``' names where it gave them), those left None (the config's) left out; a field given as text (``as_text``)
    as its text, for the config to parse."""
    values = {}
    for path in paths:
        names = (flags or {}).get(path)
        flag = cli_flag(field_at(root, path)[1]) if names is None else next(n for n in names if n.startswith("--"))
        if flag is not None and (value := getattr(args, _dest(flag))) is not None:
            values[path] = value
    return values


def from_arguments(section: Callable[..., C], args: argparse.Namespace, *paths: str, **fixed: object) -> C:
    """``section`` built from the options ``add_field_arguments`` declared for its fields at dotted ``paths`` (a
    nested dataclass's fields built into it; an option left None keeps the field's default) and ``fixed``; the
    dataclass checks every value. (A field given as text needs the config's own parsing: ``argument_values``.)"""
    values: dict[str, Any] = {}
    nested: dict[str, list[str]] = {}
    for path, value in argument_values(typing.cast(type, section), args, *paths).items():
        name, _, rest = path.partition(".")
        if rest:
            nested.setdefault(name, []).append(rest)
        else:
            values[name] = value
    for name, inner in nested.items():
        values[name] = from_arguments(typing.get_type_hints(section)[name], args, *inner)
    return section(**(values | fixed))


def cli_paths(root: type, prefix: str = "") -> tuple[str, ...]:
    """The dotted paths of every field with an option in ``root``'s tree (nested dataclasses without one walked into),
    in field order: ``add_field_arguments(parser, root, *cli_paths(root))`` declares them all."""
    paths: list[str] = []
    for f in dataclasses.fields(root):
        kind = typing.get_type_hints(root)[f.name]
        if cli_flag(f) is not None:
            paths.append(prefix + f.name)
        elif isinstance(kind, type) and dataclasses.is_dataclass(kind):
            paths += cli_paths(kind, f"{prefix}{f.name}.")
    return tuple(paths)


def field_at(root: object, path: str) -> tuple[type, dataclasses.Field[Any]]:
    """The dataclass the field at dotted ``path`` under ``root`` is declared in, and the field."""
    section, names = root, path.split(".")
    for i, name in enumerate(names):
        if not (isinstance(section, type) and dataclasses.is_dataclass(section)):
            break
        fields = {f.name: f for f in dataclasses.fields(section)}
        if name not in fields:
            break
        if i == len(names) - 1:
            return section, fields[name]
        section = _unwrap_optional(typing.get_type_hints(section)[name])
    raise ValueError(f"{path!r} names no field of {getattr(root, '__name__', root)}")


def _dest(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")


def _unwrap_optional(kind: Any) -> Any:
    """``X | None``'s X; any other type as it is."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        given = [k for k in typing.get_args(kind) if k is not type(None)]
        if len(given) == 1:
            return given[0]
    return kind


def _argument_type(kind: Any, spec: Mapping[str, Any]) -> Callable[[str], object]:
    """Parses one value of the option: the field's type (text where the config parses it), within its limits."""
    parse: Callable[[str], Any] = str if spec["as_text"] or kind not in (int, float, Path) else kind
    least, most = spec["limits"].get("min"), spec["limits"].get("max")
    if least is None and most is None:
        return parse

    def value(text: str) -> object:
        parsed = parse(text)
        if least is not None and parsed < least:
            raise argparse.ArgumentTypeError(f"must be at least {least}, got {text}")
        if most is not None and parsed > most:
            raise argparse.ArgumentTypeError(f"must be at most {most}, got {text}")
        return parsed

    value.__name__ = getattr(parse, "__name__", "value")  # argparse names the type in its error messages
    return value
