"""The swarm config: one tree of keyword-only dataclasses, built from nested dicts, a stable hash, and its derivation rules.

``SwarmConfig`` composes each component's config (model, stages, codecs, optimizers, paths); its ``hash()`` is
part of every DHT key, so peers with different configs never mix, and a section's ``ConfigError`` names the full
dotted path. What the hash leaves out and why: docs/architecture.md, the swarm config. The tree as TOML text (files,
the DHT's record, `swarmloco config show`): ``swarm/config_toml.py``.

    >>> derive_config(SwarmConfig(), {"model.preset": "125m"}, outer="diloco").swarm_id  # 'swarmloco-<16 hex digits>'
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import hashlib
import json
import re
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar, get_args

from compress.config import CodecConfig, check_choices, check_positive, choice_problem
from optim.config import (
    InnerOptimConfig,
    OuterMethod,
    OuterOptimConfig,
    fitting_pseudo_gradient_codec,
    pseudo_gradient_codec_problem,
)
from swarm.cli_fields import cli
from swarm.errors import ConfigError
from swarm.hardware import Precision
from swarm.model.stages import StagesConfig
from swarm.model.transformer import PRESET_INNER, PRESETS, ModelConfig

D = TypeVar("D")  # a config section's dataclass
ConfigValue = str | int | float | bool  # a leaf of the tree, as TOML and the command line give it


OuterChoice = Literal[
    "ddp", OuterMethod
]  # ddp: no outer step (method "none"); the simulator all-reduces fp32 gradients every step
OUTER_CHOICES: tuple[OuterChoice, ...] = get_args(OuterChoice)
SUBSPACE_RANK_DIVISOR = 8  # a subspace codec chosen without a rank gets k = d_model / 8
AUTHORITY_KEY_BYTES = 32  # an Ed25519 public key, in base64 in authority.pub and the config
# fields added after swarms were running: at these values they are left out of the hash, so those swarms keep their ids


@dataclass(kw_only=True)
class PathConfig:
    """SkipPipe-style paths: visit round((1 − skip_ratio)·S) stages, with up to ``max_swaps`` adjacent swaps.

    Each of the ``max_swaps`` swap slots is used with probability ``swap_prob`` and then swaps a
    uniformly chosen free adjacent pair. With no skips that makes the swaps (1,2) and (S−1,S) that
    CheckFree+ relies on happen in a fraction ≈ max_swaps·swap_prob/(S−1) of microbatches each.
    """

    # r: a path leaves out this fraction of the middle stages
    skip_ratio: float = field(
        default=0.0,
        metadata=cli("Skip ratio r: paths visit round((1-r)·S) stages.", flag="--skip", min=0.0, max=0.99),
    )
    # swap slots per path: adjacent stages it may visit in swapped order
    max_swaps: int = field(default=0, metadata=cli("Max adjacent stage swaps per path.", flag="--swaps", min=0))
    swap_prob: float = 0.5  # the chance that each swap slot is used

    def __post_init__(self) -> None:
        if not 0.0 <= self.skip_ratio < 1.0:
            raise ConfigError("skip_ratio", f"must be in [0, 1), got {self.skip_ratio}")
        if self.max_swaps < 0:
            raise ConfigError("max_swaps", f"must be non-negative, got {self.max_swaps}")
        if not 0.0 <= self.swap_prob <= 1.0:
            raise ConfigError("swap_prob", f"must be in [0, 1], got {self.swap_prob}")


@dataclass(kw_only=True)
class TrainConfig:
    # tokens per sample; at most model.max_seq_len
    seq_len: int = field(default=128, metadata=cli("Tokens per sample (at most the model's max_seq_len).", min=1))
    # samples per microbatch: several per inner step keep the pipeline full (issue 16)
    microbatch_size: int = field(default=4, metadata=cli("Samples per microbatch.", flag="--microbatch", min=1))
    # samples accumulated per inner optimizer step
    inner_batch: int = field(default=16, metadata=cli("Samples per inner step (a multiple of the microbatch).", min=1))
    seed: int = 0  # seeds the order trainers sample their data in (each offsets it by its --seed)
    # bf16: forward and backward under autocast, fp32 master weights and optimizer states (``swarm/hardware.py``)
    precision: Precision = field(
        default="fp32", metadata=cli("fp32, or bf16 autocast over fp32 master weights and optimizer states.")
    )

    def __post_init__(self) -> None:
        check_choices(self)
        check_positive(self, "seq_len", "microbatch_size", "inner_batch")


@dataclass(kw_only=True)
class TimeoutConfig:
    # one forward/backward hop, network included; a hop that streams (frames over 2-4 MiB) is kept alive while its
    # server computes and times out after rpc_s of silence, or 10 × rpc_s in all
    rpc_s: float = 30.0
    matchmaking_s: float = 5.0  # window in which replicas gather for an outer step
    announce_period_s: float = 5.0  # how often DHT records are refreshed
    record_ttl_s: float = 15.0  # DHT record lifetime; a silent peer disappears after this
    # clocks of honest peers differ by less: an outer-round declaration older than this (or half the window) when read
    # makes no replica late unless its declarer shows its payload
    clock_skew_s: float = 1.0

    def __post_init__(self) -> None:
        check_positive(self, *(f.name for f in dataclasses.fields(self)))
        if self.record_ttl_s <= self.announce_period_s:
            raise ConfigError("record_ttl_s", "must exceed announce_period_s, or records lapse between refreshes")


@dataclass(kw_only=True)
class DataConfig:
    """What a trainer's tokens are: the tokenizer (bpe: named by its file's sha256) and how the documents are sharded."""

    tokenizer: Literal["bytes", "bpe"] = "bytes"  # bytes: UTF-8 bytes, 256 ids; bpe: `swarmloco tokenizer train`
    tokenizer_sha256: str = ""  # bpe: sha256 (64 hex digits) of the tokenizer file every token-computing peer loads
    shards: int = 1  # trainers read 1/shards of the training documents each (shard from the peer id or --data-shard)

    def __post_init__(self) -> None:
        check_positive(self, "shards")
        if self.tokenizer == "bpe" and not re.fullmatch(r"[0-9a-f]{64}", self.tokenizer_sha256):
            raise ConfigError(
                "tokenizer_sha256",
                f"a bpe tokenizer is named by its file's sha256 (64 lowercase hex digits), got {self.tokenizer_sha256!r}",
            )
        if self.tokenizer == "bytes" and self.tokenizer_sha256:
            raise ConfigError("tokenizer_sha256", "the byte tokenizer has no file: leave tokenizer_sha256 empty")


# fields and sections added after swarms were running: at these values they are left out of the hash, so those swarms
# keep their ids (a public swarm has no authority; byte tokenizer, unsharded data; fp32)
HASHED_ONLY_IF_SET: dict[str, object] = {
    "authority": "",
    "train.precision": "fp32",
    "data": dataclasses.asdict(DataConfig()),
    "outer.warm_start_steps": 0,
    "codecs.full_boundaries": "none",
    "timeouts.clock_skew_s": 1.0,
}


@dataclass(kw_only=True)
class TrainerOptions:
    """A trainer's own options (``PeerConfig.trainer``, its ``[trainer]`` table): how it runs its pipeline, not what the
    swarm trains, so they stay out of ``SwarmConfig``. Used by swarm/pipeline/ (trainer.py, hops.py, audit.py)."""

    in_flight: int = field(
        default=4,
        metadata=cli(
            "Trainers: the most microbatches in flight at once, across inner steps (the window's cap; the window "
            "itself follows round trip × delivery rate); 1 is the synchronous pipeline.",
            min=1,
        ),
    )
    # inner steps a microbatch may land after its forward began; the window never starts one that would land staler
    # in order, and drops one overtaken past it. 0 (the default): the window stays within an inner step, so with one
    # microbatch per inner step the pipeline is synchronous. Measured (docs/benchmarks.md): spanning steps (6, with a
    # cap of 4) keeps 0.82 of the uncapped tokens/s at 20 Mbit/s instead of 0.53, but trains 9% worse at equal tokens
    # (the servers recompute a backward on weights newer than its forward's), so it is a choice, not the default
    max_staleness: int = field(
        default=0,
        metadata=cli(
            "Trainers: inner steps a microbatch may land after its forward began; staler ones are not started, "
            "or their gradients are dropped (counted). 0 keeps the window within an inner step (no staleness); "
            "more lets it span steps: faster over slow links, at a quality cost (docs/benchmarks.md).",
            min=0,
        ),
    )

    max_attempts: int = (
        3  # replicas tried per hop before the stage is skipped (forward) or the microbatch fails (backward)
    )
    max_failures_in_a_row: int = 50  # then the swarm is unusable: stop with an error instead of spinning
    log_every: int = 10  # inner steps between progress records
    check_rate: float = field(
        default=0.02,
        metadata=cli(
            "Trainers: fraction of forward hops recomputed by another replica of the stage and compared (checked "
            "pipeline work: every forward of a server until it passed one check, more of new and suspect servers); "
            "0 turns checking off.",
            min=0.0,
        ),
    )
    probe_rate: float = field(
        default=0.02,
        metadata=cli(
            "Trainers: fraction of backward hops probed by two forwards of the same server at x ± εg, on the weights "
            "its backward used, which must confirm the input gradient it returned (every backward of a server until "
            "it passed two probes; two failures in eight condemn it); 0 turns probing off.",
            min=0.0,
        ),
    )
    relay: bool = field(
        default=False,
        metadata=cli(
            "Trainers: frames go server to server: each stage server sends its output on to the next hop and the "
            "trainer only the path's ends (the trainer's link carries 2 frames a microbatch a way, not 2 per stage); "
            "control, checks and probes stay with the trainer, and any relayed frame that goes wrong falls back to "
            "the trainer's path for that hop.",
        ),
    )
    deadline_multiple: float = 4.0  # a hop's deadline: this × the server's recent p95 service time (deadlines.py)
    deadline_floor_s: float = 2.0  # the least time a hop gets
    deadline_misses: int = 2  # deadlines missed in a row (no success between) that ban a server, for a growing back-off
    eval_every: int = field(
        default=0, metadata=cli("Trainers: validation pass every N inner steps (0: only at the end).", min=0)
    )

    def __post_init__(self) -> None:
        if (
            min(self.in_flight, self.max_attempts, self.max_failures_in_a_row, self.log_every, self.deadline_misses) < 1
            or min(self.eval_every, self.max_staleness) < 0
            or not 0.0 <= self.check_rate <= 1.0
            or not 0.0 <= self.probe_rate <= 1.0
            or self.deadline_floor_s <= 0
            or self.deadline_multiple < 1
        ):
            raise ValueError(f"trainer options must be positive (eval_every, max_staleness non-negative), got {self}")


@dataclass(kw_only=True)
class SwarmConfig:
    name: str = "swarmloco"  # letters, digits, '-' and '_'; the swarm id is <name>-<hash of this config>
    authority: str = ""  # a private swarm's authority (authority.pub, base64); "" for a public swarm
    model: ModelConfig = field(default_factory=ModelConfig)
    stages: StagesConfig = field(default_factory=StagesConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    codecs: CodecConfig = field(default_factory=CodecConfig)
    inner: InnerOptimConfig = field(default_factory=InnerOptimConfig)
    outer: OuterOptimConfig = field(default_factory=OuterOptimConfig)
    paths: PathConfig = field(default_factory=PathConfig)
    timeouts: TimeoutConfig = field(default_factory=TimeoutConfig)
    data: DataConfig = field(default_factory=DataConfig)

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("-", "").replace("_", "").isalnum():
            raise ConfigError("name", f"must be non-empty letters, digits, '-' or '_', got {self.name!r}")
        if self.authority and not _is_public_key(self.authority):
            raise ConfigError(
                "authority", f"must be the swarm authority's public key (authority.pub), got {self.authority[:60]!r}"
            )
        if self.stages.num_stages > self.model.n_layers:
            raise ConfigError(
                "stages.num_stages",
                f"{self.stages.num_stages} stages need at least as many blocks, model.n_layers={self.model.n_layers}",
            )
        if self.train.seq_len > self.model.max_seq_len:
            raise ConfigError(
                "train.seq_len", f"{self.train.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}"
            )
        if self.train.inner_batch % self.train.microbatch_size:
            raise ConfigError(
                "train.inner_batch", f"must be a multiple of train.microbatch_size={self.train.microbatch_size}"
            )
        if self.codecs.uses_subspace and not self.model.subspace_rank:
            raise ConfigError(
                "codecs.activations", "subspace codecs need a subspace-constrained model (set model.subspace_rank)"
            )
        if (problem := pseudo_gradient_codec_problem(self.outer.method, self.codecs.pseudo_gradients)) is not None:
            raise ConfigError("codecs.pseudo_gradients", problem)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def hash(self) -> str:
        """Stable 16-hex-digit identity of the swarm (any field change gives a new swarm)."""
        fields = self.to_dict()
        del fields["model"]["preset"]  # derived from the model's shape (``ModelConfig``), which is hashed
        for path, default in HASHED_ONLY_IF_SET.items():
            *sections, leaf = path.split(".")
            table = functools.reduce(lambda t, name: t[name], sections, fields)
            if table[leaf] == default:
                del table[leaf]
        canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    @property
    def swarm_id(self) -> str:
        return f"{self.name}-{self.hash()}"


def _is_public_key(text: str) -> bool:
    try:
        return len(base64.b64decode(text, validate=True)) == AUTHORITY_KEY_BYTES
    except ValueError:  # not base64
        return False


def derive_config(
    base: SwarmConfig, overrides: Mapping[str, ConfigValue] | None = None, *, outer: OuterChoice | None = None
) -> SwarmConfig:
    """``base`` with dotted-path ``overrides`` set and the rules that keep a config whole applied; validated once, as a whole.

    The rules (every front end — CLI, launcher, benchmarks — derives its configs here):
    - ``model.preset``: the preset's shape and inner optimizer (``preset_fields``) replace the base's;
    - ``outer``: the outer method, where "ddp" means method "none" (the simulator all-reduces gradients instead);
    - ``codecs.gradients`` follows an overridden ``codecs.activations`` unless overridden itself;
    - ``codecs.pseudo_gradients`` is "sparseloco" under SparseLoCo; DiLoCo cannot send "sparseloco" and gets "fp32";
    - a subspace codec on a model without a subspace gets ``model.subspace_rank = d_model / 8``.

        >>> derive_config(SwarmConfig(), {"outer.inner_steps": 10, "codecs.activations": "fp16"}, outer="diloco").codecs
        CodecConfig(activations='fp16', gradients='fp16', pseudo_gradients='fp32', …)
    """
    overrides = dict(overrides or {})
    if "codecs.activations" in overrides:
        overrides.setdefault("codecs.gradients", overrides["codecs.activations"])
    if outer is not None:
        overrides["outer.method"] = "none" if outer == "ddp" else outer
    data = base.to_dict()
    if (
        "model.preset" in overrides
    ):  # a new preset brings its whole shape and inner optimizer, except what is overridden
        for section, fields in preset_fields(overrides["model.preset"]).items():
            data[section].update(fields)  # the overrides are set below, over these
    for path, value in overrides.items():
        _set_field(data, path, value)
    sections = _fields_from_dict(SwarmConfig, data, "")  # every section built and checked; the whole is checked below
    sections["codecs"], sections["model"] = _fit_codecs(
        typing.cast(CodecConfig, sections["codecs"]),
        typing.cast(ModelConfig, sections["model"]),
        typing.cast(OuterOptimConfig, sections["outer"]).method,
    )
    return SwarmConfig(**sections)  # type: ignore[arg-type]  # each section built and checked by _fields_from_dict


def preset_fields(preset: object) -> dict[str, dict[str, Any]]:
    """What naming model preset ``preset`` brings, by section: its shape (``PRESETS``) and its inner optimizer's defaults
    (``PRESET_INNER``); nothing for a name that is no preset ("custom", or a wrong one ``ModelConfig`` then refuses).

        >>> preset_fields("125m")["inner"]  # {'lr': 0.0006, 'warmup_steps': 100}
    """
    if not isinstance(preset, str) or preset not in PRESETS:
        return {}
    return {"model": PRESETS[preset], "inner": PRESET_INNER[preset]}


def follow_run(cfg: SwarmConfig, steps: int, *, schedule_set: bool) -> SwarmConfig:
    """``cfg`` for a run of ``steps`` inner steps (``local``, ``train-local``): its cosine schedule as long as the run,
    unless the config sets ``inner.total_steps`` itself (``schedule_set``; ``config_toml.sets_field`` reads that in a file)."""
    return cfg if schedule_set else derive_config(cfg, {"inner.total_steps": steps})


def parse_overrides(pairs: Iterable[str]) -> dict[str, ConfigValue]:
    """Command-line ``PATH=VALUE`` pairs as ``derive_config`` overrides; each value an int, else a float, else the text
    (``derive_config`` checks paths and types). A pair without ``=`` is a ``ValueError``.

        >>> parse_overrides(["train.microbatch_size=4", "inner.lr=0.001"])  # {'train.microbatch_size': 4, 'inner.lr': 0.001}
    """
    overrides: dict[str, ConfigValue] = {}
    for pair in pairs:
        path, sep, text = pair.partition("=")
        if not sep or not path:
            raise ValueError(f"{pair!r}: expected PATH=VALUE, e.g. train.inner_batch=64")
        for parse in (int, float):
            try:
                overrides[path] = parse(text)
                break
            except ValueError:
                continue
        else:
            overrides[path] = text
    return overrides


def _fit_codecs(codecs: CodecConfig, model: ModelConfig, method: OuterMethod) -> tuple[CodecConfig, ModelConfig]:
    """The pseudo-gradient codec the outer method can send, and a subspace model wherever a subspace codec is chosen."""
    pseudo_gradients = fitting_pseudo_gradient_codec(method, codecs.pseudo_gradients)
    codecs = dataclasses.replace(codecs, pseudo_gradients=pseudo_gradients)
    if codecs.uses_subspace and not model.subspace_rank:
        model = dataclasses.replace(model, subspace_rank=model.d_model // SUBSPACE_RANK_DIVISOR)
    return codecs, model


def _set_field(data: dict[str, Any], path: str, value: ConfigValue) -> None:
    """Set the leaf at dotted ``path`` in the nested dicts of a config (the sections must exist)."""
    *sections, leaf = path.split(".")
    table = data
    for depth, section in enumerate(sections):
        inner = table.get(section)
        if not isinstance(inner, dict):
            raise ConfigError(
                ".".join(sections[: depth + 1]),
                f"unknown section; known sections: {', '.join(k for k, v in table.items() if isinstance(v, dict))}",
            )
        table = inner
    if isinstance(table.get(leaf), dict):
        raise ConfigError(path, f"is a section; set one of its fields ({path}.<field>)")
    if leaf not in table:
        raise ConfigError(
            path,
            f"unknown field; known fields: {', '.join(sorted(k for k, v in table.items() if not isinstance(v, dict)))}",
        )
    table[leaf] = value


def _join(section: str, name: str) -> str:
    return f"{section}.{name}" if section else name


def from_dict(cls: type[D], data: dict[str, Any], path: str = "") -> D:
    """Build dataclass ``cls`` (at dotted ``path`` in the tree) from nested dicts; errors name the full dotted field path."""
    kwargs = _fields_from_dict(cls, data, path)
    try:
        return cls(**kwargs)
    except ConfigError as e:  # the section names its own field; the path above it is known only here
        raise e.within(path) from None


def _fields_from_dict(cls: type, data: dict[str, Any], path: str) -> dict[str, object]:
    """The checked constructor arguments of dataclass ``cls`` from ``data``: sections built, leaves type- and choice-checked."""
    if not isinstance(data, dict):
        raise ConfigError(path or "<root>", f"expected a table, got {type(data).__name__}")
    if cls is SwarmConfig and isinstance(data.get("model"), dict):  # a named preset fills the fields left out
        for section, fields in preset_fields(data["model"].get("preset")).items():
            if isinstance(data.get(section, {}), dict):  # not a table: its own check says so
                data = {**data, section: {**fields, **data.get(section, {})}}
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(_join(path, unknown[0]), f"unknown field; known fields: {', '.join(sorted(known))}")
    kwargs: dict[str, object] = {}
    for name, value in data.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            # a section's dataclass, read from the type hints (is_dataclass narrows it to an instance-or-type union)
            kwargs[name] = from_dict(hint, value, _join(path, name))  # type: ignore[arg-type]
        else:
            kwargs[name] = _check_scalar(value, hint, _join(path, name))
    return kwargs


def _check_scalar(value: object, hint: object, path: str) -> object:
    """``value`` if it fits type ``hint`` (a type, a union of types, or a ``Literal`` of choices); ints widen to float."""
    if typing.get_origin(hint) is Literal:
        problem = choice_problem(value, hint)
        if problem:
            raise ConfigError(path, problem)
        return value
    allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if float in allowed and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not any(isinstance(value, t) and not (t is int and isinstance(value, bool)) for t in allowed):
        names = " | ".join(getattr(t, "__name__", str(t)) for t in allowed)
        raise ConfigError(path, f"expected {names}, got {type(value).__name__} {value!r}")
    return value


def config_from_dict(data: dict[str, Any]) -> SwarmConfig:
    return from_dict(SwarmConfig, data)
