"""The swarm's activation and activation-gradient codecs, built from its config."""

from __future__ import annotations

import torch

from compress.adaptive import ADAPTIVE, ADAPTIVE_LADDER, ADAPTIVE_START, Ladder
from compress.codecs import Codec, Kind, get_codec
from swarm.config import SwarmConfig
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
