"""Model checkpoints: saved and loaded whole; anything else is refused with one short line that never advises loading
with ``weights_only=False`` (which runs the file's code)."""

from __future__ import annotations

import collections
import pickle
import zipfile
from pathlib import Path

import pytest
import torch

from swarm.model.transformer import Transformer
from swarm.recovery.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from swarmtest.configs import tiny_config


class Foreign:
    """An object the weights-only unpickler refuses."""


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    cfg = tiny_config()
    save_checkpoint(tmp_path / "model.pt", cfg, Transformer(cfg.model), steps=3)
    return tmp_path / "model.pt"


def test_a_checkpoint_loads_back_whole(checkpoint: Path) -> None:
    cfg, model, meta = load_checkpoint(checkpoint)
    assert cfg == tiny_config() and meta == {"steps": 3}
    assert not list(checkpoint.parent.glob("*.tmp"))


def garbage(path: Path, checkpoint: Path) -> None:
    path.write_text("garbage\n")


def truncated(path: Path, checkpoint: Path) -> None:
    data = checkpoint.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def empty(path: Path, checkpoint: Path) -> None:
    path.write_bytes(b"")


def foreign_object(path: Path, checkpoint: Path) -> None:
    torch.save({"format": "swarmloco-checkpoint-v1", "model": Foreign()}, path)


def other_torch_file(path: Path, checkpoint: Path) -> None:
    torch.save({"weights": torch.zeros(3)}, path)


def plain_pickle(path: Path, checkpoint: Path) -> None:
    path.write_bytes(pickle.dumps(collections.OrderedDict(a=1)))


def other_zip(path: Path, checkpoint: Path) -> None:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("x", "y")


@pytest.mark.parametrize(
    "make,reason",
    [
        (garbage, "not a torch archive"),
        (truncated, "a damaged or truncated torch archive: PytorchStreamReader failed reading zip archive"),
        (empty, "an empty file"),
        (foreign_object, f"unpickling refused: it holds {__name__}.Foreign besides tensors"),
        (other_torch_file, "a torch archive without the swarmloco-checkpoint-v1 tag"),
        (plain_pickle, "not a torch archive"),
        (other_zip, "a damaged or truncated torch archive"),
    ],
)
def test_a_file_that_is_no_checkpoint_gets_a_short_safe_reason(
    tmp_path: Path, checkpoint: Path, make, reason: str
) -> None:
    path = tmp_path / "bad.pt"
    make(path, checkpoint)
    with pytest.raises(CheckpointError) as raised:
        load_checkpoint(path)
    message = str(raised.value)
    assert message.startswith(f"{path} is not a swarmloco checkpoint ({reason}")
    assert "swarmloco train-local" in message
    assert "weights_only" not in message and "\n" not in message and len(message) < 300


def test_a_path_that_cannot_be_read_or_written_says_so(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "missing.pt")
    with pytest.raises(CheckpointError, match=f"cannot read checkpoint {tmp_path}: Is a directory"):
        load_checkpoint(tmp_path)
    (tmp_path / "file").write_text("")
    cfg = tiny_config()
    with pytest.raises(OSError) as raised:  # the CLI turns an OSError naming its path into one line
        save_checkpoint(tmp_path / "file" / "model.pt", cfg, Transformer(cfg.model))
    assert raised.value.filename == str(tmp_path / "file")
