"""Paced compute (``--pace-as h200``): a benchmark mode in which a peer runs the real swarm at a reference device's pace
on any machine. Instead of a stage's math, a stage server waits the reference device's time for that microbatch's
forward or backward and replies with a real boundary tensor recorded once from the real model at the swarm's shapes;
a trainer does the same for its embedding and head. Everything else is real: p2p, frames, codecs (the replayed
tensors are real activations and gradients, so the codecs and zstd see realistic frames), routing, the window,
deadlines and metering. The weights do not train (every microbatch's loss is the recording's).

    >>> bank = record_boundaries(cfg, inputs, targets)  # one real microbatch through every stage and back (slow on a CPU)
    >>> pace = Pace.of(cfg, "h200", bank)               # H200's one-process rate, split by the stages' FLOPs
    >>> StageServer(cfg, 1, pace=pace); Trainer(cfg, calls, router, pace=pace)

Checks and probes judge a server's work by recomputing it; replayed outputs would fail them, so a paced trainer turns
both off (``Trainer``), and it runs no validation pass (the loss is the recording's). What a CPU pays and a GPU would
not: a replayed tensor's frame is encoded once per codec and then resent as is (``Pace.encode``: the same bytes the
codec gives it each time); incoming frames are decoded for real. docs/architecture.md, "The throughput model".
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from compress.codec_base import Codec
from swarm.config import SwarmConfig
from swarm.model.reference import FORWARD_SHARE, reference_rate, reference_seconds
from swarm.model.stages import EDGE_STAGE, EdgeStage, MiddleStage, build_stage
from swarm.model.step import head_loss_gradients, stage_forward, stage_gradients

BOUNDARIES_FORMAT = 1  # the file's layout version (``Boundaries.save``)


@dataclass(frozen=True)
class Boundaries:
    """One real microbatch's boundary tensors (B, T, d), fp32 on the CPU: ``activations[s]`` is stage s's output (0:
    the embedding's), ``gradients[s]`` the loss's gradient with respect to it (S: from the head); ``tokens`` (B, T)
    its input ids, ``loss`` its loss."""

    activations: tuple[torch.Tensor, ...]
    gradients: tuple[torch.Tensor, ...]
    tokens: torch.Tensor
    loss: float

    def __post_init__(self) -> None:
        shapes = {tuple(t.shape) for t in (*self.activations, *self.gradients)}
        if len(self.activations) != len(self.gradients) or len(self.activations) < 2 or len(shapes) != 1:
            raise ValueError("boundaries need one activation and one gradient of one shape per stage 0..S")

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.activations[0].shape)

    @property
    def stages(self) -> int:
        """S: the middle stages recorded."""
        return len(self.activations) - 1

    def save(self, path: Path) -> None:
        torch.save(
            {
                "format": BOUNDARIES_FORMAT,
                "activations": list(self.activations),
                "gradients": list(self.gradients),
                "tokens": self.tokens,
                "loss": self.loss,
            },
            path,
        )

    @classmethod
    def load(cls, path: Path) -> Boundaries:
        saved = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(saved, dict) or saved.get("format") != BOUNDARIES_FORMAT:
            raise ValueError(f"{path} holds no boundary tensors of format {BOUNDARIES_FORMAT}")
        return cls(
            activations=tuple(saved["activations"]),
            gradients=tuple(saved["gradients"]),
            tokens=saved["tokens"],
            loss=float(saved["loss"]),
        )

    def check(self, cfg: SwarmConfig) -> None:
        """A ValueError unless these are boundaries of cfg's microbatch shape and stages."""
        want = (cfg.train.microbatch_size, cfg.train.seq_len, cfg.model.d_model)
        if self.shape != want or self.stages != cfg.stages.num_stages:
            raise ValueError(
                f"the recorded boundaries are {self.stages} stages of {self.shape}; this swarm's are "
                f"{cfg.stages.num_stages} of {want}: record them at its shapes"
            )


def record_boundaries(cfg: SwarmConfig, inputs: torch.Tensor, targets: torch.Tensor) -> Boundaries:
    """``inputs`` (B, T) through cfg's seeded stages and back, in fp32 on the CPU, one stage's graph at a time (each
    backward recomputes its forward): every boundary's activation and gradient. The math of swarm/model/step.py."""
    S = cfg.stages.num_stages
    edge = build_stage(cfg.model, S, EDGE_STAGE)
    assert isinstance(edge, EdgeStage)
    with torch.no_grad():
        activations = [edge.embed(inputs)]
    for s in range(1, S + 1):
        stage = build_stage(cfg.model, S, s)
        assert isinstance(stage, MiddleStage)
        activations.append(stage_forward(stage, activations[-1]))
        del stage
    loss, grad, _ = head_loss_gradients(edge, activations[-1], targets, inner_batch=cfg.train.inner_batch)
    gradients = [grad]
    for s in range(S, 0, -1):
        stage = build_stage(cfg.model, S, s)
        assert isinstance(stage, MiddleStage)
        grad, _ = stage_gradients(stage, activations[s - 1], gradients[0])
        gradients.insert(0, grad)
        del stage
    return Boundaries(
        activations=tuple(a.detach().contiguous() for a in activations),
        gradients=tuple(g.detach().contiguous() for g in gradients),
        tokens=inputs.clone(),
        loss=float(loss),
    )


def random_tokens(cfg: SwarmConfig, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """One microbatch of uniformly random token ids at cfg's shapes (inputs, targets): what a paced peer records from
    when no recording is given (a corpus's embedding frames compress far better: record from real text to compare)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, cfg.model.vocab_size, (cfg.train.microbatch_size, cfg.train.seq_len + 1), generator=g)
    return x[:, :-1], x[:, 1:]


@dataclass
class Pace:
    """What a paced peer waits and replays: ``seconds[s]``, the reference device's forward + backward of stage s per
    microbatch (0: the trainer's head; the embedding is a lookup), and the recorded ``boundaries``."""

    device: str  # what is paced as: a reference device's name, or one process's tokens/s
    tokens_per_s: float
    seconds: tuple[float, ...]
    boundaries: Boundaries
    sleep: Callable[[float], None] = time.sleep
    clock: Callable[[], float] = time.perf_counter
    _frames: dict[tuple[str, int], bytes] = field(default_factory=dict, repr=False)  # (codec, tensor) → its frame

    @classmethod
    def of(cls, cfg: SwarmConfig, spec: str, boundaries: Boundaries) -> Pace:
        """The pace of ``spec`` (``--pace-as``: a reference device, or one process's tokens/s) for cfg's model."""
        boundaries.check(cfg)
        rate = reference_rate(spec, cfg.model.preset)
        seconds = reference_seconds(
            cfg.model,
            num_stages=cfg.stages.num_stages,
            seq_len=cfg.train.seq_len,
            microbatch=cfg.train.microbatch_size,
            tokens_per_s=rate,
        )
        return cls(device=spec, tokens_per_s=rate, seconds=tuple(seconds), boundaries=boundaries)

    def describe(self) -> str:
        stages = ", ".join(f"{1000 * s:.1f}" for s in self.seconds[1:])
        return (
            f"paced as {self.device} ({self.tokens_per_s:,.0f} tokens/s alone): stages {stages} ms, the trainer's "
            f"head {1000 * self.seconds[0]:.2f} ms a microbatch, forward + backward; outputs replayed, not computed"
        )

    def forward_s(self, stage: int) -> float:
        return FORWARD_SHARE * self.seconds[stage]

    def backward_s(self, stage: int) -> float:
        return (1 - FORWARD_SHARE) * self.seconds[stage]

    def wait(self, seconds: float, *, since: float) -> None:
        """Until ``seconds`` after ``since`` (the clock's): the reference device's time, less what the call already
        took on this machine."""
        left = since + seconds - self.clock()
        if left > 0:
            self.sleep(left)

    def forward(self, stage: int, samples: int) -> torch.Tensor:
        """Stage ``stage``'s forward at the reference pace: its time waited, its recorded output."""
        self.wait(self.forward_s(stage), since=self.clock())
        return self.output(stage, samples)

    def backward(self, stage: int, samples: int) -> torch.Tensor:
        """Stage ``stage``'s backward at the reference pace: its time waited, its recorded input gradient."""
        self.wait(self.backward_s(stage), since=self.clock())
        return self.input_gradient(stage, samples)

    def output(self, stage: int, samples: int) -> torch.Tensor:
        """Stage ``stage``'s output (0: the embedding's) for a microbatch of ``samples``."""
        return self._first(self.boundaries.activations[stage], samples)

    def input_gradient(self, stage: int, samples: int) -> torch.Tensor:
        """The gradient stage ``stage``'s backward returns (with respect to its input)."""
        return self._first(self.boundaries.gradients[stage - 1], samples)

    def output_gradient(self, samples: int) -> torch.Tensor:
        """The gradient the trainer's head returns (with respect to the last stage's output)."""
        return self._first(self.boundaries.gradients[-1], samples)

    def tokens(self, samples: int) -> torch.Tensor:
        return self._first(self.boundaries.tokens, samples)

    @staticmethod
    def _first(t: torch.Tensor, samples: int) -> torch.Tensor:
        return t if samples == t.shape[0] else t[:samples]

    def encode(self, codec: Codec, t: torch.Tensor, tokens: torch.Tensor | None) -> bytes:
        """``codec.encode(t, tokens=tokens)``, encoded once for a replayed tensor and resent as is after (the codecs
        are deterministic: the same bytes): a GPU would encode it in a millisecond, this machine's CPU in tens."""
        replayed = t.data_ptr() in self._replayed and tuple(t.shape) == self.boundaries.shape
        if not replayed:
            return codec.encode(t, tokens=tokens)
        key = (codec.name, t.data_ptr())
        if key not in self._frames:
            self._frames[key] = codec.encode(t, tokens=tokens)
        return self._frames[key]

    @property
    def _replayed(self) -> set[int]:
        b = self.boundaries
        return {t.data_ptr() for t in (*b.activations, *b.gradients)}


def load_pace(cfg: SwarmConfig, spec: str, boundaries: Path | None, *, log: Callable[[str], None] = print) -> Pace:
    """The pace of ``--pace-as spec``: its boundaries from the file ``boundaries`` (``scripts/bench_gpu_pace.py``
    records one from real text), else recorded now from random tokens (the whole model's forward and backward once:
    a minute or more on a CPU at 125m)."""
    if boundaries is not None:
        bank = Boundaries.load(boundaries)
    else:
        started = time.perf_counter()
        bank = record_boundaries(cfg, *random_tokens(cfg))
        log(f"paced: recorded the boundaries of one random microbatch in {time.perf_counter() - started:.1f}s")
    pace = Pace.of(cfg, spec, bank)
    log(pace.describe())
    return pace
