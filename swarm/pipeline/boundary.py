"""The swarm's activation and activation-gradient codecs, built from its config, and ``Link``: a boundary in one process.

>>> link = Link(*boundary_codecs(cfg))   # what a pipelined hop does to a tensor, its bytes counted by kind
>>> full_replica_link(cfg, device)        # a full replica's own boundaries: None (in memory) unless compressed
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import torch

from compress.adaptive import ADAPTIVE, ADAPTIVE_LADDER, ADAPTIVE_START, Ladder
from compress.codec_base import Codec
from compress.codecs import Kind, get_codec
from swarm.config import SwarmConfig
from swarm.hardware import CPU
from swarm.model.transformer import subspace_basis


def boundary_ladders(cfg: SwarmConfig) -> tuple[Ladder, Ladder]:
    """(forward activation ladder, backward activation-gradient ladder) for every stage boundary: the codecs a sender
    may choose per link and a receiver accepts. A fixed codec is a ladder of one; ``"adaptive"`` is bf16 → int8 → int4,
    in the subspace codec for a subspace-constrained model (its frames are smaller still, and exact)."""
    basis, table = subspace_basis(cfg.model) if cfg.model.subspace_rank else (None, None)
    forward = _ladder(cfg.codecs.activations, "activation", basis, table)
    backward = _ladder(cfg.codecs.gradients, "gradient", basis, table)
    return forward, backward


def boundary_codecs(cfg: SwarmConfig) -> tuple[Codec, Codec]:
    """(forward, backward) codec of a link nobody measured: the configured codec, or an adaptive ladder's start (the
    simulator's, which has no links)."""
    forward, backward = boundary_ladders(cfg)
    return forward.start, backward.start


def _ladder(name: str, kind: Kind, basis: torch.Tensor | None, table: torch.Tensor | None) -> Ladder:
    if name != ADAPTIVE:
        return Ladder([get_codec(name, basis=basis, table=table, kind=kind)])
    prefix = "" if basis is None else "subspace+"
    names = [prefix + rung for rung in ADAPTIVE_LADDER]
    return Ladder(
        [get_codec(n, basis=basis, table=table, kind=kind) for n in names],
        start=names.index(prefix + ADAPTIVE_START),
    )


class Link:
    """Encodes and decodes a tensor exactly as a peer would, counting the wire bytes by kind."""

    def __init__(self, forward: Codec, backward: Codec, *, device: torch.device = CPU, zstd: bool = True) -> None:
        self.codecs = {"activations": forward, "activation_gradients": backward}
        self.device = device  # tensors are coded and decoded here, as a peer does on its own device
        # zstd runs on the host (~30 ms for a 125m microbatch's frame on one core): off, the frames never leave the
        # device and are counted before zstd (the values decoded are the same: zstd is lossless)
        self.zstd = zstd
        self.bytes: Counter[str] = Counter()
        self.messages: Counter[str] = Counter()

    def send(self, kind: str, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """``x`` as its receiver decodes it, on this link's device: only the coded frame crosses to the host and back
        (with ``zstd`` off, not even that)."""
        codec = self.codecs[kind]
        if self.zstd:
            frame = codec.encode(x.detach(), tokens=tokens)
            y, nbytes = codec.decode(frame, device=self.device), len(frame)
        else:
            y, nbytes = codec.round_trip(x.to(self.device), tokens)
        self.bytes[kind] += nbytes
        self.messages[kind] += 1
        return y


def fp32_boundaries(cfg: SwarmConfig) -> SwarmConfig:
    """``cfg`` with uncompressed boundaries: a full replica hands tensors from stage to stage in its own memory."""
    return dataclasses.replace(cfg, codecs=dataclasses.replace(cfg.codecs, activations="fp32", gradients="fp32"))


def full_replica_link(cfg: SwarmConfig, device: torch.device = CPU, *, zstd: bool = True) -> Link | None:
    """How a full replica hands tensors between its own stages (``codecs.full_boundaries``): None, in memory (the
    default: only pipelined replicas' links are compressed), or a ``Link`` through the swarm's boundary codecs."""
    if cfg.codecs.full_boundaries == "none":
        return None
    return Link(*boundary_codecs(cfg), device=device, zstd=zstd)
