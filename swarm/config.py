"""The swarm config: one tree of keyword-only dataclasses, TOML in and out, and a stable hash.

Each component keeps its config beside it (model, stages, codecs, optimizers, paths); this
module composes them. The hash identifies the swarm: it is part of every DHT key, so peers
with different configs never mix.

    >>> cfg = SwarmConfig()
    >>> save_config(cfg, "swarm.toml"); assert load_config("swarm.toml") == cfg
    >>> cfg.hash()  # '3f9c…' (16 hex digits)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

from compress.config import CodecConfig
from optim.config import InnerOptimConfig, OuterOptimConfig
from swarm.errors import ConfigError
from swarm.model.transformer import ModelConfig
from swarm.pipeline.routing import PathConfig
from swarm.model.stages import StagesConfig


@dataclass(kw_only=True)
class TrainConfig:
    seq_len: int = 128  # tokens per sample; at most model.max_seq_len
    microbatch_size: int = 16  # samples per microbatch
    inner_batch: int = 16  # samples accumulated per inner optimizer step
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("seq_len", "microbatch_size", "inner_batch"):
            if getattr(self, name) <= 0:
                raise ConfigError(name, f"must be positive, got {getattr(self, name)}")


@dataclass(kw_only=True)
class TimeoutConfig:
    rpc_s: float = 30.0  # one forward/backward hop, network included
    matchmaking_s: float = 5.0  # window in which replicas gather for an outer step
    announce_period_s: float = 5.0  # how often DHT records are refreshed
    record_ttl_s: float = 15.0  # DHT record lifetime; a silent peer disappears after this

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if getattr(self, f.name) <= 0:
                raise ConfigError(f.name, f"must be positive, got {getattr(self, f.name)}")
        if self.record_ttl_s <= self.announce_period_s:
            raise ConfigError("record_ttl_s", "must exceed announce_period_s, or records lapse between refreshes")


@dataclass(kw_only=True)
class SwarmConfig:
    name: str = "swarmloco"
    model: ModelConfig = field(default_factory=ModelConfig)
    stages: StagesConfig = field(default_factory=StagesConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    codecs: CodecConfig = field(default_factory=CodecConfig)
    inner: InnerOptimConfig = field(default_factory=InnerOptimConfig)
    outer: OuterOptimConfig = field(default_factory=OuterOptimConfig)
    paths: PathConfig = field(default_factory=PathConfig)
    timeouts: TimeoutConfig = field(default_factory=TimeoutConfig)

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("-", "").replace("_", "").isalnum():
            raise ConfigError("name", f"must be non-empty letters, digits, '-' or '_', got {self.name!r}")
        if self.stages.num_stages > self.model.n_layers:
            raise ConfigError("stages.num_stages", f"{self.stages.num_stages} stages need at least as many blocks, model.n_layers={self.model.n_layers}")
        if self.train.seq_len > self.model.max_seq_len:
            raise ConfigError("train.seq_len", f"{self.train.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}")
        if self.train.inner_batch % self.train.microbatch_size:
            raise ConfigError("train.inner_batch", f"must be a multiple of train.microbatch_size={self.train.microbatch_size}")
        uses_subspace = any(c.startswith("subspace") for c in (self.codecs.activations, self.codecs.gradients))
        if uses_subspace and not self.model.subspace_rank:
            raise ConfigError("codecs.activations", "subspace codecs need a subspace-constrained model (set model.subspace_rank)")
        if (self.codecs.pseudo_gradients == "sparseloco") != (self.outer.method == "sparseloco") and self.outer.method != "none":
            raise ConfigError("codecs.pseudo_gradients", f"{self.codecs.pseudo_gradients!r} does not fit outer.method={self.outer.method!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def hash(self) -> str:
        """Stable 16-hex-digit identity of the swarm (any field change gives a new swarm)."""
        canonical = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    @property
    def swarm_id(self) -> str:
        return f"{self.name}-{self.hash()}"


def from_dict(cls: type, data: dict[str, Any], path: str = "") -> Any:
    """Build dataclass ``cls`` from nested dicts; errors name the dotted field path."""
    if not isinstance(data, dict):
        raise ConfigError(path.rstrip(".") or "<root>", f"expected a table, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"{path}{unknown[0]}", f"unknown field; known fields: {', '.join(sorted(known))}")
    kwargs = {}
    for name, value in data.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = from_dict(hint, value, f"{path}{name}.")
        else:
            kwargs[name] = _check_scalar(value, hint, f"{path}{name}")
    try:
        return cls(**kwargs)
    except ConfigError as e:
        if path and not e.field.startswith(path):
            raise ConfigError(f"{path}{e.field}", str(e).split(": ", 1)[1]) from None
        raise
    except ValueError as e:  # a component config outside swarm/ names only its own field
        match = re.fullmatch(r"config field '(\w+)': (.*)", str(e), flags=re.S)
        field_name, problem = match.groups() if match else ("", str(e))
        raise ConfigError(f"{path}{field_name}".rstrip(".") or "<root>", problem) from None


def _check_scalar(value: Any, hint: Any, path: str) -> Any:
    allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if float in allowed and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not any(isinstance(value, t) and not (t is int and isinstance(value, bool)) for t in allowed):
        names = " | ".join(getattr(t, "__name__", str(t)) for t in allowed)
        raise ConfigError(path, f"expected {names}, got {type(value).__name__} {value!r}")
    return value


def config_from_dict(data: dict[str, Any]) -> SwarmConfig:
    return from_dict(SwarmConfig, data)


def load_config(path: str | Path) -> SwarmConfig:
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError("<file>", f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError("<file>", f"{path} is not valid TOML: {e}") from None
    return config_from_dict(data)


def dumps_config(cfg: SwarmConfig) -> str:
    return tomli_w.dumps(cfg.to_dict())


def save_config(cfg: SwarmConfig, path: str | Path) -> None:
    Path(path).write_text(dumps_config(cfg))
