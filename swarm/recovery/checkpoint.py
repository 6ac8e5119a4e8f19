"""One-file checkpoints of a whole model with the swarm config that defines it.

>>> save_checkpoint("model.pt", cfg, model, step=300)
>>> cfg, model, meta = load_checkpoint("model.pt")
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path
from typing import Any

import torch

from swarm.config import SwarmConfig, config_from_dict
from swarm.model.transformer import Transformer

FORMAT = "swarmloco-checkpoint-v1"
ZIP_MAGIC = b"PK\x03\x04"  # torch.save writes a zip archive


class CheckpointError(ValueError):
    """The file is not a swarmloco checkpoint or does not match its config."""


def save_checkpoint(path: str | Path, cfg: SwarmConfig, model: Transformer, **meta: Any) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("wb") as f:  # opened here: a path that cannot be written raises OSError naming it, not torch's error
        torch.save({"format": FORMAT, "config": cfg.to_dict(), "model": model.state_dict(), "meta": meta}, f)
    tmp.replace(path)  # atomic: a crash never leaves a half-written checkpoint


def load_checkpoint(path: str | Path) -> tuple[SwarmConfig, Transformer, dict[str, Any]]:
    path = Path(path)
    blob = read_archive(path)
    if not isinstance(blob, dict) or blob.get("format") != FORMAT or not isinstance(blob.get("model"), dict):
        raise not_a_checkpoint(path, f"a torch archive without the {FORMAT} tag")
    if not isinstance(blob.get("config"), dict):
        raise not_a_checkpoint(path, "its swarm config is missing")
    cfg = config_from_dict(blob["config"])
    model = Transformer(cfg.model)
    try:
        model.load_state_dict(blob["model"])
    except RuntimeError as e:
        raise CheckpointError(f"{path}: weights do not match its config: {e}") from None
    return cfg, model, blob.get("meta", {})


def read_archive(path: Path) -> Any:
    """A torch zip archive's content, loaded with ``weights_only`` (tensors and plain data: no code runs); a
    CheckpointError with a short reason for anything else. Never the legacy pickle format: checkpoints are archives."""
    try:
        with path.open("rb") as f:
            magic = f.read(len(ZIP_MAGIC))
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} does not exist") from None
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {e.strerror or e}") from None
    if magic != ZIP_MAGIC:
        raise not_a_checkpoint(path, "not a torch archive" if magic else "an empty file")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:  # the weights-only unpickler refused an object
        refused = re.search(r"GLOBAL (\S+)", str(e))
        raise not_a_checkpoint(
            path, f"unpickling refused: it holds {refused[1] if refused else 'objects'} besides tensors and plain data"
        ) from None
    except Exception as e:  # torch raises many types for damaged archives
        raise not_a_checkpoint(path, f"a damaged or truncated torch archive: {short_reason(e)}") from None


def not_a_checkpoint(path: Path, reason: str) -> CheckpointError:
    return CheckpointError(
        f"{path} is not a swarmloco checkpoint ({reason}); checkpoints are written by swarmloco train-local, local "
        f"and export"
    )


def short_reason(error: Exception) -> str:
    """The first sentence of torch's message, never its advice to load with ``weights_only=False`` (which runs code)."""
    message = re.sub(r"^\[enforce fail at [^\]]*\][\s.]*", "", str(error).strip())  # c10's source location
    first = message.splitlines()[0].split(". ")[0].rstrip(".") if message else ""
    return type(error).__name__ if not first or "weights_only" in first else first
