"""Command-line options that set config fields, each typed from its config tree (``SwarmConfig`` or ``PeerConfig``).

A command lists its ``ConfigOption``s in ``@config_options(...)`` and takes ``overrides``: the decorator puts one typer
option per entry there, typed (and so its choices, for ``Literal`` fields) from the dataclasses, its help and limits
from the field's ``cli`` metadata (``compress/config.py``), and hands the command ``{dotted field: value}`` for the
options given. A command names the field and the flag(s) it gives it, and at most a note of its own (e.g. its own
default); ``field_options(PeerConfig)`` makes one per field with ``cli`` metadata under the field's own flag, so a
command's options, their help and defaults are written once, on its config dataclass; ``from_options`` builds the
dataclass back from the overrides the command receives.

    @app.command("simulate")
    @config_options(ConfigOption(field="codecs.activations", flags=("--act-codec",)))
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

from swarm.cli_fields import cli_flag, cli_spec, field_at, negated
from swarm.config import ConfigValue, SwarmConfig

F = TypeVar("F", bound=Callable[..., object])
C = TypeVar("C")  # a config dataclass
ConfigOverrides = Mapping[str, ConfigValue] | None  # the parameter a decorated command receives the overrides in
OVERRIDES_PARAM = "overrides"


def field_type(path: str, root: type = SwarmConfig) -> object:
    """The declared type of the leaf at dotted ``path`` in the dataclass tree under ``root``."""
    section, f = field_at(root, path)
    return typing.get_type_hints(section)[f.name]


@dataclass(frozen=True, kw_only=True)
class ConfigOption:
    """One command-line option that sets the config field ``field`` (dotted path in ``root``'s tree) under ``flags``
    (none given: the field's own, a boolean's with its ``--no-`` form); its help, least and greatest values and its
    choices are the field's (its ``cli`` metadata and ``Literal`` type).

    >>> ConfigOption(field="paths.skip_ratio").param  # 'skip' (the field's flag)
    >>> ConfigOption(field="codecs.activations", flags=("--codec",), note="(default int8)").help  # the field's + note
    """

    field: str
    flags: tuple[str, ...] = ()  # the command's own names for the option; (): the field's
    default: ConfigValue | None = None  # None: the config's own value
    root: type = SwarmConfig  # the config tree ``field`` is a path in
    # the command's own words after the field's help; None: "(default: the config's)" where ``default`` is None
    note: str | None = None

    def __post_init__(self) -> None:
        spec = self.spec  # a field without cli metadata is no option: say so where the command declares it
        if not self.flags:  # the field's own
            section, f = field_at(self.root, self.field)
            flag = cli_flag(f) or ""
            if typing.get_type_hints(section)[f.name] is bool:
                flag = f"{flag}/{negated(flag)}"
            object.__setattr__(self, "flags", (flag, *spec["aliases"]))  # frozen: set once, here

    @property
    def spec(self) -> Mapping[str, typing.Any]:
        """The field's ``cli`` metadata."""
        if (spec := cli_spec(field_at(self.root, self.field)[1])) is None:
            raise ValueError(f"{self.root.__name__}.{self.field} has no command-line option (no cli metadata)")
        return spec

    @property
    def help(self) -> str:
        """The field's help, and the command's note."""
        note = self.note if self.note is not None else "(default: the config's)" if self.default is None else ""
        return f"{self.spec['help']} {note}".strip()

    @property
    def limits(self) -> Mapping[str, float]:
        """typer's min / max, checked while parsing: the field's."""
        limits: Mapping[str, float] = self.spec["limits"]
        return limits

    @property
    def param(self) -> str:
        """The Python parameter name: the first long flag, as typer would name it."""
        long = next(flag for flag in self.flags if flag.startswith("--")).split("/")[0]  # --x/--no-x: x
        return long[2:].replace("-", "_").replace(".", "_")

    def annotation(self) -> object:
        # text where the command line gives text the config parses, else the field's type
        kind = (str | None) if self.spec["as_text"] else field_type(self.field, self.root)
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
        if cli_flag(f) is None:
            if isinstance(kind, type) and dataclasses.is_dataclass(kind):
                options += field_options(root, section=kind, prefix=f"{path}.", only=only)
            continue
        if only is not None and path not in only:
            continue
        options.append(
            ConfigOption(
                field=path,
                default=f.default if isinstance(f.default, str | int | float | bool) else None,
                root=root,
                note="",
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
