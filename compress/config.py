"""Which codecs a swarm uses on the wire (part of the swarm config), and what every config section shares: its checks,
and ``cli``, the metadata a field declares its command-line option with.

Config sections are keyword-only dataclasses whose choice fields are ``Literal`` types;
``__post_init__`` validates and raises ``ConfigError`` naming the field relative to the section
(the enclosing section prefixes its own name). ``cli`` lives here, at the bottom of the layers, so that optim/'s and
compress/'s sections declare their options on their own fields too; ``swarm/cli_fields.py`` reads it (and re-exports it).

    >>> CodecConfig(activations="subspace+int8", gradients="subspace").uses_subspace  # True
    >>> CodecConfig(activations="adaptive", gradients="adaptive")  # per link, by measured throughput
    >>> CodecConfig(activations="gzip")  # ConfigError: config field 'activations': unknown value 'gzip'; choose from fp32, …
"""

from __future__ import annotations

import functools
import typing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from compress.codecs import CodecName, PseudoGradientCodecName
from compress.errors import ConfigError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

# a codec, or "adaptive": per link, from bf16 to int4 by the link's measured throughput (compress/adaptive.py)
BoundaryCodecName = Literal[CodecName, "adaptive"]

FullBoundaries = Literal["none", "compressed"]
SPARSELOCO_CHUNK = 4096  # the SparseLoCo codec's chunks are 64×64 tiles


def cli(
    help: str,
    *,
    flag: str | None = None,
    aliases: tuple[str, ...] = (),
    min: float | None = None,
    max: float | None = None,
    as_text: bool = False,
) -> dict[str, object]:
    """A config field's command-line option, as the field's metadata: its ``--help`` text, its flag (default
    ``--field-name``) and other names (e.g. ``-k``), the least and greatest values the command line accepts, and
    ``as_text`` for a field the command line gives as text that the config parses (its ``str`` is that text). A
    ``Literal`` field's choices are its type's. Read by ``swarm/cli_fields.py`` and ``peer/config_options.py``.

    >>> steps: int = field(default=100, metadata=cli("Trainers: inner steps of stage 0 to run.", min=1))
    """
    limits = {name: value for name, value in (("min", min), ("max", max)) if value is not None}
    return {"cli": {"help": help, "flag": flag, "aliases": aliases, "limits": limits, "as_text": as_text}}


def choice_problem(value: object, choices: object) -> str | None:
    """Why ``value`` is not one of the ``Literal`` type ``choices`` (None when it is); the one message for every choice field."""
    allowed = typing.get_args(choices)
    if any(value == choice and type(value) is type(choice) for choice in allowed):  # Literal[1] must not take True
        return None
    return f"unknown value {value!r}; choose from {', '.join(map(str, allowed))}"


@functools.cache
def _choice_fields(cls: type) -> dict[str, object]:
    return {name: hint for name, hint in typing.get_type_hints(cls).items() if typing.get_origin(hint) is Literal}


def check_choices(section: DataclassInstance) -> None:
    """Raise ``ConfigError`` for the first ``Literal``-typed field of dataclass ``section`` holding a value outside its choices."""
    for name, choices in _choice_fields(type(section)).items():
        problem = choice_problem(getattr(section, name), choices)
        if problem:
            raise ConfigError(name, problem)


def check_positive(section: object, *names: str) -> None:
    for name in names:
        if not getattr(section, name) > 0:
            raise ConfigError(name, f"must be positive, got {getattr(section, name)}")


def check_non_negative(section: object, *names: str) -> None:
    for name in names:
        if getattr(section, name) < 0:
            raise ConfigError(name, f"must be non-negative, got {getattr(section, name)}")


@dataclass(kw_only=True)
class CodecConfig:
    # forward activations between stages
    activations: BoundaryCodecName = field(
        default="int8",
        metadata=cli(
            "Boundary codec of the activations between stages, and of their gradients unless those are given their "
            "own (adaptive: per link, by its measured throughput).",
            flag="--act-codec",
        ),
    )
    # activation-gradients on the way back
    gradients: BoundaryCodecName = field(
        default="int8",
        metadata=cli("Boundary codec of the activation gradients (default: the activations').", flag="--grad-codec"),
    )
    # a full replica's own stage boundaries (``swarm/full.py``): "none", handed over in memory (selective compression:
    # only the pipelined replicas' links are compressed); "compressed", through the two codecs above as if they crossed a
    # wire (every replica compressed alike, what selective compression is compared against)
    full_boundaries: FullBoundaries = "none"
    # outer-step exchange (sparseloco needs outer.method = sparseloco)
    pseudo_gradients: PseudoGradientCodecName = field(
        default="sparseloco",
        metadata=cli("Codec of the outer step's pseudo-gradients (SparseLoCo sends its own).", flag="--pg-codec"),
    )
    topk: int = 64  # SparseLoCo: values kept per chunk
    chunk_size: int = SPARSELOCO_CHUNK  # SparseLoCo: elements per chunk (2-D tensors as 64×64 tiles)
    error_decay: float = 0.95  # SparseLoCo: β of the error-feedback buffer

    def __post_init__(self) -> None:
        check_choices(self)
        if self.chunk_size != SPARSELOCO_CHUNK:
            raise ConfigError("chunk_size", f"only {SPARSELOCO_CHUNK} (64×64 tiles) is supported")
        if not 1 <= self.topk <= self.chunk_size:
            raise ConfigError("topk", f"must be in [1, {self.chunk_size}], got {self.topk}")
        if not 0.0 <= self.error_decay <= 1.0:
            raise ConfigError("error_decay", f"must be in [0, 1], got {self.error_decay}")

    @property
    def uses_subspace(self) -> bool:
        """Whether a boundary codec needs the subspace-constrained model (``model.subspace_rank`` > 0)."""
        return any(name.startswith("subspace") for name in (self.activations, self.gradients))
