"""The outer optimizer a swarm config names: DiLoCo, SparseLoCo or NoLoCo (or none).

Apart from ``optim/outer.py`` so the dependency points one way: NoLoCo (``optim/noloco.py``) builds on
``outer.py``'s base class, and this module imports both.

    opt = build_outer_optimizer(dict(model.named_parameters()), cfg.outer, cfg.codecs)
"""

from __future__ import annotations

from typing import Any

from compress.codecs import get_codec
from compress.config import CodecConfig
from compress.sparseloco import SparseLoCoCodec
from optim.config import OuterOptimConfig, pseudo_gradient_codec_problem
from optim.noloco import NoLoCo
from optim.outer import DiLoCo, NamedTensors, OuterOptimizer, SparseLoCo


def build_outer_optimizer(
    params: NamedTensors, cfg: OuterOptimConfig, codecs: CodecConfig
) -> OuterOptimizer[Any] | None:
    """The stage's outer optimizer from the swarm config; None when ``cfg.method == "none"``."""
    if cfg.method == "none":
        return None
    if (problem := pseudo_gradient_codec_problem(cfg.method, codecs.pseudo_gradients)) is not None:
        raise ValueError(f"pseudo-gradient codec {problem}")
    if cfg.method == "diloco":
        return DiLoCo(params, lr=cfg.diloco_lr, momentum=cfg.diloco_momentum, codec=get_codec(codecs.pseudo_gradients))
    if cfg.method == "noloco":
        return NoLoCo(params, lr=cfg.noloco_lr, momentum=cfg.noloco_momentum, codec=get_codec(codecs.pseudo_gradients))
    codec = SparseLoCoCodec(topk=codecs.topk, chunk_size=codecs.chunk_size, error_decay=codecs.error_decay)
    return SparseLoCo(params, lr=cfg.sparseloco_lr, momentum=cfg.sparseloco_momentum, codec=codec)
