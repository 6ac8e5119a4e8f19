"""Command-line options that set config fields, each typed from its config tree (``SwarmConfig`` or ``PeerConfig``).

A command lists its ``ConfigOption``s in ``@config_options(...)`` and takes ``overrides``: the decorator puts one typer
option per entry there, typed (and so its choices, for ``Literal`` fields) from the dataclasses, and hands the command
``{dotted field: value}`` for the options given. ``field_options(PeerConfig)`` makes one per field with ``cli`` metadata
(``swarm/cli_fields.py``), so a command's options, their help and defaults are written once, on its config dataclass;
``from_options`` builds the dataclass back from the overrides the command receives.

    @app.command("simulate")
    @config_options(ConfigOption(field="codecs.activations", flags=("--act-codec",), help="Activation codec."))
    def simulate_cmd(config: ConfigOpt = None, overrides: ConfigOverrides = None) -> None:
        cfg = derive_config(config_or_default(config), overrides)
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Annotated, TypeVar

import typer

from swarm.cli_fields import cli_flag, cli_spec, negated
from swarm.config import ConfigValue, SwarmConfig

F = TypeVar("F", bound=Callable[..., object])
C = TypeVar("C")  # a config dataclass
ConfigOverrides = Mapping[str, ConfigValue] | None  # the parameter a decorated command receives the overrides in
OVERRIDES_PARAM = "overrides"


def field_type(path: str, root: type = SwarmConfig) -> object:
    """The declared type of the leaf at dotted ``path`` in the dataclass tree under ``root``."""
    section: object = root
    for name in path.split("."):
        if not (isinstance(section, type) and dataclasses.is_dataclass(section)) or name not in {
            f.name for f in dataclasses.fields(section)
        }:
            raise ValueError(f"{path!r} names no field of {root.__name__}")
        section = typing.get_type_hints(section)[name]
    return section


@dataclass(frozen=True, kw_only=True)
class ConfigOption:
    """One command-line option that sets the swarm-config field ``field`` (dotted path).

    >>> ConfigOption(field="paths.skip_ratio", flags=("--skip",), help="Skip ratio.", limits={"min": 0.0, "max": 0.99}).param  # 'skip'
    """

    field: str
    flags: tuple[str, ...]
    help: str
    default: ConfigValue | None = None  # None: the config's own value
    root: type = SwarmConfig  # the config tree ``field`` is a path in
    kind: object = None  # the option's type where the command line gives text the config parses (None: the field's)
    limits: Mapping[str, float] = dataclasses.field(default_factory=dict)  # typer's min / max, checked while parsing

    @property
    def param(self) -> str:
        """The Python parameter name: the first long flag, as typer would name it."""
        long = next(flag for flag in self.flags if flag.startswith("--")).split("/")[0]  # --x/--no-x: x
        return long[2:].replace("-", "_").replace(".", "_")

    def annotation(self) -> object:
        kind = self.kind or field_type(self.field, self.root)
        option = typer.Option(*self.flags, help=self.help, min=self.limits.get("min"), max=self.limits.get("max"))
        return Annotated[kind if self.default is not None else typing.Optional[kind], option]  # noqa: UP045 (a value)


def field_options(
    root: type, *, section: type | None = None, prefix: str = "", only: Collection[str] | None = None
) -> tuple[ConfigOption, ...]:
    """One option per field of ``root`` (and of its nested dataclasses) that has ``cli`` metadata
    (``swarm.cli_fields.cli``; ``only``: those of these dotted names), its default the field's plain default (a
    factory's: None, the config's own); a boolean field's flag comes with its ``--no-`` form."""
    section = section or root
    options: list[ConfigOption] = []
    for f in dataclasses.fields(section):
        path, kind = prefix + f.name, typing.get_type_hints(section)[f.name]
        if (spec := cli_spec(f)) is None or (flag := cli_flag(f)) is None:
            if isinstance(kind, type) and dataclasses.is_dataclass(kind):
                options += field_options(root, section=kind, prefix=f"{path}.", only=only)
            continue
        if only is not None and path not in only:
            continue
        options.append(
            ConfigOption(
                field=path,
                flags=(f"{flag}/{negated(flag)}" if kind is bool else flag, *spec["aliases"]),
                help=spec["help"],
                default=f.default if isinstance(f.default, str | int | float | bool) else None,
                limits=spec["limits"],
                root=root,
                kind=(str | None) if spec["as_text"] else None,
            )
        )
    return tuple(options)


def from_options(section: Callable[..., C], options: ConfigOverrides, **fixed: object) -> C:
    """The config dataclass ``section`` built from the overrides its ``field_options`` gave (its own flat fields) and
    ``fixed``; the dataclass checks every value."""
    values: dict[str, object] = {**(options or {}), **fixed}
    return section(**values)


def config_options(*options: ConfigOption, into: str = OVERRIDES_PARAM) -> Callable[[F], F]:
    """Decorator: the command gets one option per ``ConfigOption`` in place of its parameter ``into`` (default
    ``overrides``), which receives ``{dotted field: value}`` of the options given."""

    def decorate(command: F) -> F:
        signature = inspect.signature(command)
        if into not in signature.parameters:
            raise TypeError(f"{command.__name__} needs an {into!r} parameter to receive its config options")
        added = [
            inspect.Parameter(o.param, inspect.Parameter.KEYWORD_ONLY, default=o.default, annotation=o.annotation())
            for o in options
        ]
        params: list[inspect.Parameter] = []
        for p in signature.parameters.values():  # typer passes every option by keyword
            params += added if p.name == into else [p.replace(kind=inspect.Parameter.KEYWORD_ONLY)]

        @functools.wraps(command)
        def wrapper(**kwargs: object) -> object:
            overrides = {o.field: value for o in options if (value := kwargs.pop(o.param)) is not None}
            return command(**kwargs, **{into: overrides})

        # typer reads the options from __signature__, which functions have at run time but not in typeshed
        wrapper.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
        wrapper.__annotations__ = {p.name: p.annotation for p in params}
        return wrapper  # type: ignore[return-value]  # F's signature, rewritten for typer, is not F's type

    return decorate
