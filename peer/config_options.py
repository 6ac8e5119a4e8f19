"""Command-line options that set swarm-config fields, declared once each as (flags, dotted field) and typed from the tree.

A command lists its ``ConfigOption``s in ``@config_options(...)`` and takes ``overrides``: the
decorator puts one typer option per entry where ``overrides`` stands in the signature, its type
(and so its choices, for ``Literal`` fields) read from the config dataclasses, and hands the
command ``{dotted field: value}`` for the options given, ready for ``swarm.config.derive_config``.

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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, TypeVar

import typer

from swarm.config import ConfigValue, SwarmConfig

F = TypeVar("F", bound=Callable[..., object])
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
    limits: Mapping[str, float] = dataclasses.field(default_factory=dict)  # typer's min / max, checked while parsing

    @property
    def param(self) -> str:
        """The Python parameter name: the first long flag, as typer would name it."""
        long = next(flag for flag in self.flags if flag.startswith("--"))
        return long[2:].replace("-", "_").replace(".", "_")

    def annotation(self) -> object:
        kind = field_type(self.field)
        return Annotated[
            kind if self.default is not None else kind | None, typer.Option(*self.flags, help=self.help, **self.limits)
        ]  # type: ignore[operator]


def config_options(*options: ConfigOption) -> Callable[[F], F]:
    """Decorator: the command gets one option per ``ConfigOption`` (in place of its ``overrides`` parameter) and receives them as ``overrides``."""

    def decorate(command: F) -> F:
        signature = inspect.signature(command)
        if OVERRIDES_PARAM not in signature.parameters:
            raise TypeError(f"{command.__name__} needs an {OVERRIDES_PARAM!r} parameter to receive its config options")
        added = [
            inspect.Parameter(o.param, inspect.Parameter.KEYWORD_ONLY, default=o.default, annotation=o.annotation())
            for o in options
        ]
        params: list[inspect.Parameter] = []
        for p in signature.parameters.values():  # typer passes every option by keyword
            params += added if p.name == OVERRIDES_PARAM else [p.replace(kind=inspect.Parameter.KEYWORD_ONLY)]

        @functools.wraps(command)
        def wrapper(**kwargs: object) -> object:
            overrides = {o.field: value for o in options if (value := kwargs.pop(o.param)) is not None}
            return command(**kwargs, **{OVERRIDES_PARAM: overrides})

        wrapper.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
        wrapper.__annotations__ = {p.name: p.annotation for p in params}
        return wrapper  # type: ignore[return-value]

    return decorate
