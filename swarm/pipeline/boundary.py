"""The swarm's activation and activation-gradient codecs, built from its config."""

from __future__ import annotations

from compress.codecs import Codec, get_codec
from swarm.config import SwarmConfig
from swarm.model.transformer import subspace_basis


def boundary_codecs(cfg: SwarmConfig) -> tuple[Codec, Codec]:
    """(forward activation codec, backward activation-gradient codec) for every stage boundary."""
    basis, table = subspace_basis(cfg.model) if cfg.model.subspace_rank else (None, None)
    forward = get_codec(cfg.codecs.activations, basis=basis, table=table, kind="activation")
    backward = get_codec(cfg.codecs.gradients, basis=basis, table=table, kind="gradient")
    return forward, backward
