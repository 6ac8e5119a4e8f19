"""One-file checkpoints of a whole model with the swarm config that defines it.

>>> save_checkpoint("model.pt", cfg, model, step=300)
>>> cfg, model, meta = load_checkpoint("model.pt")
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from swarm.config import SwarmConfig, config_from_dict
from swarm.model.transformer import Transformer

FORMAT = "swarmloco-checkpoint-v1"


class CheckpointError(ValueError):
    """The file is not a swarmloco checkpoint or does not match its config."""


def save_checkpoint(path: str | Path, cfg: SwarmConfig, model: Transformer, **meta: Any) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save({"format": FORMAT, "config": cfg.to_dict(), "model": model.state_dict(), "meta": meta}, tmp)
    tmp.replace(path)  # atomic: a crash never leaves a half-written checkpoint


def load_checkpoint(path: str | Path) -> tuple[SwarmConfig, Transformer, dict[str, Any]]:
    try:
        blob = torch.load(Path(path), map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} does not exist") from None
    except Exception as e:  # torch raises many types for foreign or corrupt files
        raise CheckpointError(f"{path} is not a readable checkpoint: {e}") from None
    if not isinstance(blob, dict) or blob.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a {FORMAT} file")
    cfg = config_from_dict(blob["config"])
    model = Transformer(cfg.model)
    try:
        model.load_state_dict(blob["model"])
    except RuntimeError as e:
        raise CheckpointError(f"{path}: weights do not match its config: {e}") from None
    return cfg, model, blob.get("meta", {})
