"""``swarmloco export``: a running swarm's model, or a saved checkpoint, written as a swarmloco checkpoint or a
Hugging Face LLaMA folder.

From a swarm it joins the DHT as a client (it serves nothing), reads which peers serve each stage, downloads every
middle stage from one of its servers and stage 0 from a trainer (``swarm/export.py``). ``pt`` writes the checkpoint
``swarmloco eval`` and ``swarmloco sample`` load; ``hf`` writes a folder (config.json, model.safetensors and the
tokenizer when one is given) that ``transformers.LlamaForCausalLM.from_pretrained`` loads (``swarm/model/hf.py``).

    $ swarmloco export --initial-peers /ip4/…/p2p/12D3… -o model.pt
    $ swarmloco export --checkpoint runs/train-local/model.pt --format hf -o model-hf
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

from peer.tokenizer import file_sha256
from swarm.config import SwarmConfig
from swarm.errors import ExportError
from swarm.model.hf import NotLlamaError, llama_config, to_llama_state_dict
from swarm.model.transformer import ModelConfig, Transformer
from swarm.recovery.checkpoint import load_checkpoint, save_checkpoint

if TYPE_CHECKING:  # these load hivemind, which an export from a checkpoint does not need
    from swarm.outer.state import StageState
    from swarm.rpc.admission import Credentials

ExportFormat = Literal["pt", "hf"]
EXPORT_FORMATS: tuple[str, ...] = get_args(ExportFormat)
DEFAULT_OUT: dict[str, Path] = {"pt": Path("model.pt"), "hf": Path("model-hf")}
HF_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
BYTE_VOCAB = 256  # peer/data.py's default tokenizer: token id = byte value


@dataclass(frozen=True)
class ExportTarget:
    """Where and how to write a model, checked before anything is downloaded or written."""

    out: Path
    format: ExportFormat = "pt"
    tokenizer: str | None = None  # hf: the tokenizers JSON to write beside the model


def check_swarm_tokenizer(cfg: SwarmConfig, tokenizer: Path | None) -> None:
    """A swarm trained with a BPE tokenizer exports only that tokenizer's file (by its sha256, as peers check it)."""
    if tokenizer is None or cfg.data.tokenizer != "bpe":
        return
    try:
        sha256 = file_sha256(tokenizer)
    except OSError as e:
        raise ExportError(f"cannot read tokenizer {tokenizer}: {e.strerror or e}") from None
    if sha256 != cfg.data.tokenizer_sha256:
        raise ExportError(
            f"--tokenizer {tokenizer} has sha256 {sha256[:12]}…, but the model was trained with the tokenizer of sha256 "
            f"{cfg.data.tokenizer_sha256[:12]}…: give that file"
        )


def export_target(
    out: Path, model: ModelConfig, *, format: ExportFormat = "pt", tokenizer: Path | None = None
) -> ExportTarget:
    """The target, or ExportError saying why the model cannot be written there in that format."""
    if format not in EXPORT_FORMATS:
        raise ExportError(f"unknown format {format!r}: choose one of {', '.join(EXPORT_FORMATS)}")
    if format == "pt":
        if tokenizer is not None:
            raise ExportError("--tokenizer goes with --format hf: a swarmloco checkpoint holds no tokenizer")
        if out.is_dir():
            raise ExportError(f"{out} is a folder: --format pt writes one file")
        return ExportTarget(out)
    try:
        llama_config(model)
    except NotLlamaError as e:
        raise ExportError(str(e)) from None
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out} is a file: --format hf writes a folder")
    others = sorted(p.name for p in out.iterdir() if p.name not in HF_FILES) if out.is_dir() else []
    if others:  # never overwrite a folder of something else; a previous export's files are replaced
        raise ExportError(f"{out} holds other files ({', '.join(others[:3])}): give a new or empty folder")
    return ExportTarget(out, "hf", None if tokenizer is None else read_tokenizer(tokenizer, model.vocab_size))


def read_tokenizer(path: Path, vocab_size: int) -> str:
    """The text of a ``tokenizers`` JSON file whose token ids all fit the model's vocabulary."""
    try:
        text = path.read_text(encoding="utf-8")
        spec = json.loads(text)
    except OSError as e:
        raise ExportError(f"cannot read tokenizer {path}: {e.strerror or e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ExportError(f"{path} is not a tokenizer file (the JSON that `tokenizers` saves)") from None
    if not isinstance(spec, dict) or not isinstance(spec.get("model"), dict):
        raise ExportError(f"{path} is not a tokenizer file: no tokenizer model in it")
    vocab = spec["model"].get("vocab") or {}
    ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))  # Unigram: a list of pieces
    ids += [token.get("id", 0) for token in spec.get("added_tokens") or [] if isinstance(token, dict)]
    largest = max((i for i in ids if isinstance(i, int)), default=-1)
    if largest >= vocab_size:
        raise ExportError(
            f"tokenizer {path} has token ids up to {largest}, but the model's vocabulary has {vocab_size} entries"
        )
    return text


def write_model(target: ExportTarget, cfg: SwarmConfig, model: Transformer, meta: Mapping[str, Any]) -> list[str]:
    """Write the model where ``target`` says; returns the summary lines to print."""
    count = f"{sum(p.numel() for p in model.parameters()):,} parameters"
    if target.format == "pt":
        save_checkpoint(target.out, cfg, model, **meta)
        return [f"wrote {target.out}: {count}"]
    written = write_hf_folder(target, cfg.model, model, meta)
    lines = [
        f"wrote {target.out}/ ({', '.join(written)}): {count} as a Hugging Face LLaMA "
        f"(transformers.AutoModelForCausalLM.from_pretrained({str(target.out)!r}))"
    ]
    if target.tokenizer is None:
        lines.append(
            "no tokenizer written: the model reads UTF-8 bytes (token id = byte value), encode with list(text.encode())"
            if cfg.model.vocab_size == BYTE_VOCAB
            else f"no tokenizer written: pass --tokenizer (the model's vocabulary has {cfg.model.vocab_size} entries)"
        )
    return lines


def write_hf_folder(
    target: ExportTarget, model_cfg: ModelConfig, model: Transformer, meta: Mapping[str, Any]
) -> list[str]:
    """config.json, model.safetensors and the tokenizer's files, each written whole (tmp + rename); returns their names."""
    from safetensors.torch import save_file

    out = target.out
    out.mkdir(parents=True, exist_ok=True)
    files = {"config.json": json.dumps(llama_config(model_cfg), indent=2) + "\n"}
    if target.tokenizer is not None:
        files["tokenizer.json"] = target.tokenizer
        files["tokenizer_config.json"] = json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model_cfg.max_seq_len}, indent=2
        )
    for name in set(HF_FILES) - set(files) - {"model.safetensors"}:
        (out / name).unlink(missing_ok=True)  # a previous export's tokenizer would not belong to this model
    tmp = out / "model.safetensors.tmp"
    # "format": "pt" is what transformers 4.x checks; the export's provenance rides along
    save_file(to_llama_state_dict(model), tmp, metadata={"format": "pt", "swarmloco": json.dumps(meta, default=str)})
    os.replace(tmp, out / "model.safetensors")
    for name, text in files.items():
        (out / f"{name}.tmp").write_text(text, encoding="utf-8")
        os.replace(out / f"{name}.tmp", out / name)
    return [*files, "model.safetensors"]


def export_checkpoint(
    checkpoint: Path,
    out: Path,
    *,
    format: ExportFormat = "pt",
    tokenizer: Path | None = None,
    on_progress: Callable[[str], None] = lambda line: None,
) -> dict[str, Any]:
    """Write a saved checkpoint's model to ``out`` in ``format``; returns the checkpoint's metadata."""
    cfg, model, meta = load_checkpoint(checkpoint)
    check_swarm_tokenizer(cfg, tokenizer)
    target = export_target(out, cfg.model, format=format, tokenizer=tokenizer)
    on_progress(f"checkpoint {checkpoint}: swarm {cfg.swarm_id}, {cfg.model.n_layers} blocks")
    for line in write_model(target, cfg, model, {**meta, "exported_from_checkpoint": str(checkpoint)}):
        on_progress(line)
    return meta


async def export_swarm(
    initial_peers: list[str],
    cfg: SwarmConfig | None,
    out: Path,
    *,
    name: str,
    format: ExportFormat = "pt",
    tokenizer: Path | None = None,
    identity_path: str | None = None,
    credentials: Credentials | None = None,
    timeout_s: float = 60.0,
    have: Mapping[int, StageState] | None = None,
    on_progress: Callable[[str], None] = lambda line: None,
) -> dict[str, Any]:
    """Write the swarm's current model to ``out`` in ``format`` (the stages in ``have`` from there, not the swarm);
    returns the export's metadata. The target is checked before anything is downloaded."""
    from swarm.dht.start import watch_swarm
    from swarm.export import download_model, export_sources
    from swarm.pipeline.protocol import StageClient
    from swarm.rpc.blobs import BlobClient

    async with watch_swarm(
        initial_peers, cfg, name=name, identity_path=identity_path, credentials=credentials
    ) as membership:
        cfg = membership.cfg
        check_swarm_tokenizer(cfg, tokenizer)
        target = export_target(out, cfg.model, format=format, tokenizer=tokenizer)
        on_progress(
            f"swarm {cfg.swarm_id}: {cfg.stages.num_stages} middle stages + stage 0, {cfg.model.n_layers} blocks"
        )
        sources = export_sources(await membership.all_replicas(), cfg.stages.num_stages, have=have or {})
        p2p = await membership.dht.replicate_p2p()
        # private swarms: the certificate goes with each request
        certificate = StageClient(p2p, namespace=cfg.swarm_id, credentials=credentials).certificate
        client = BlobClient(p2p, namespace=cfg.swarm_id, certificate=certificate)
        fetch = lambda peer, blob, sink, max_bytes: client.stream(
            peer, blob, sink, timeout=timeout_s, max_bytes=max_bytes
        )
        model, meta = await download_model(cfg, sources, fetch, have=have, on_progress=on_progress)
    for line in write_model(target, cfg, model, meta):
        on_progress(line)
    return meta
