"""The swarm config as TOML text: read from a file, written bare (the DHT's config record) or commented (swarm.toml,
`swarmloco config show`), each section's and field's meaning read from the comments beside it in the source.

    >>> save_config(cfg := SwarmConfig(), "swarm.toml"); assert load_config("swarm.toml") == cfg  # fields commented
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import io
import textwrap
import tokenize
import tomllib
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Literal, get_args

import tomli_w

from swarm.config import SwarmConfig, config_from_dict
from swarm.errors import ConfigError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance


# fields a run derives unless the config sets them (``follow_run``): the commented TOML writes them commented out while
# they hold their default, so a file that `swarmloco config show` printed leaves them to the run (and loads back alike)
LEFT_TO_THE_RUN = frozenset({"inner.total_steps"})


def load_config(path: str | Path) -> SwarmConfig:
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError("<file>", f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError("<file>", f"{path} is not valid TOML: {e}") from None
    return config_from_dict(data)


def sets_field(path: str | Path | None, field: str) -> bool:
    """Whether the config file at ``path`` (None: the built-in config, which sets nothing) gives dotted ``field`` itself,
    rather than leaving it to its default, its preset or the run."""
    if path is None:
        return False
    table: object = tomllib.loads(Path(path).read_text())
    for name in field.split("."):
        if not isinstance(table, dict) or name not in table:
            return False
        table = table[name]
    return True


def dumps_config(cfg: SwarmConfig, *, commented: bool = False) -> str:
    """The config as TOML: bare (the DHT's config record), or ``commented``, each section's and field's meaning above it
    (``class_docs``), a ``Literal`` field's choices too: what swarm.toml holds and ``swarmloco config show`` prints.
    Either loads back (``load_config``) as ``cfg``."""
    if not commented:
        return tomli_w.dumps(cfg.to_dict())
    lines = _comment(
        f"swarmloco swarm config. Every peer of swarm {cfg.swarm_id} runs it: the id is the name and a hash of the "
        "fields below, so a peer with any other value is in another swarm. A field left out takes its default "
        "(`swarmloco config show` prints them all)."
    )
    lines.append("")
    _commented_table(cfg, (), lines)
    return "\n".join(lines) + "\n"


def save_config(cfg: SwarmConfig, path: str | Path) -> None:
    """Write ``cfg`` to ``path`` as commented TOML (``dumps_config``)."""
    Path(path).write_text(dumps_config(cfg, commented=True))


@functools.cache
def class_docs(cls: type) -> tuple[str, dict[str, str]]:
    """The meaning of config section ``cls`` (its docstring) and of each of its fields: the comment lines right above the
    field and the comment on its own line(s), read from the source (the one place they are written; Python gives
    dataclass fields no docstrings). ("", {}) where the source cannot be read."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return "", {}
    comments: dict[int, tuple[str, bool]] = {}  # line -> (text, whether the comment is all its line holds)
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            alone = not token.line[: token.start[1]].strip()
            comments[token.start[0]] = (token.string.lstrip("#").strip(), alone)
    (node,) = ast.parse(source).body
    assert isinstance(node, ast.ClassDef)
    docs: dict[str, str] = {}
    for statement in node.body:
        if not (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)):
            continue
        above: list[str] = []
        line = statement.lineno - 1
        while line in comments and comments[line][1]:
            above.insert(0, comments[line][0])
            line -= 1
        end = statement.end_lineno or statement.lineno
        beside = [comments[n][0] for n in range(statement.lineno, end + 1) if n in comments]
        if text := " ".join(above + beside):
            docs[statement.target.id] = text
    return " ".join((ast.get_docstring(node) or "").split()), docs


def _commented_table(section: DataclassInstance, path: tuple[str, ...], lines: list[str]) -> None:
    """Append dataclass ``section`` (at ``path`` in the tree) as TOML, each field's meaning above it: its own fields
    first, then its sections (TOML puts a table's keys before its sub-tables)."""
    cls = type(section)
    doc, docs = class_docs(cls)
    hints = typing.get_type_hints(cls)
    if path:
        lines += ["", *_comment(doc), f"[{'.'.join(path)}]"]
    sections: list[tuple[str, DataclassInstance]] = []
    for f in dataclasses.fields(cls):
        value = getattr(section, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            sections.append((f.name, value))
            continue
        lines += _comment(docs.get(f.name, ""))
        if typing.get_origin(hints[f.name]) is Literal:
            lines += _comment(f"one of: {', '.join(map(str, get_args(hints[f.name])))}")
        line = tomli_w.dumps({f.name: value}).rstrip("\n")
        left_to_run = ".".join((*path, f.name)) in LEFT_TO_THE_RUN and value == f.default
        lines.append(f"# {line}" if left_to_run else line)
    for name, value in sections:
        _commented_table(value, (*path, name), lines)


def _comment(text: str, width: int = 100) -> list[str]:
    """``text`` as TOML comment lines (its ``code`` spans in Markdown's single backticks)."""
    return [f"# {line}" for line in textwrap.wrap(text.replace("``", "`"), width - 2)]
