"""Export a 125M-style model as a Hugging Face LLaMA and check that transformers computes swarmloco's logits.

Builds ``ModelConfig(d_model=768, n_layers=12, n_heads=12, max_seq_len=1024)`` (dims given here, not a preset),
moves its weights off their init with a few AdamW steps, saves it as a swarmloco checkpoint, exports that with
``export_checkpoint(..., format="hf")`` (what ``swarmloco export --checkpoint F --format hf`` runs), loads the folder
with ``transformers.LlamaForCausalLM.from_pretrained`` and compares logits on the same random tokens (fp32 on
both sides). Prints the max abs difference against the 1e-4 bound and the time of every step; exits 1 if over.
Needs transformers (the dev extra).

    python scripts/check_hf_export.py --json check_hf_export.json
    python scripts/check_hf_export.py --vocab-size 32000 --tokens 1024 --device cuda
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
from transformers import LlamaForCausalLM

from peer.export import export_checkpoint
from swarm.config import SwarmConfig
from swarm.model.stages import StagesConfig
from swarm.model.transformer import ModelConfig, Transformer, loss_fn
from swarm.recovery.checkpoint import save_checkpoint

T = TypeVar("T")
TOLERANCE = 1e-4


def timed(timings: dict[str, float], step: str, fn: Callable[[], T]) -> T:
    started = time.perf_counter()
    result = fn()
    timings[step] = round(time.perf_counter() - started, 3)
    return result


def off_init(model: Transformer, steps: int, seq_len: int, seed: int) -> None:
    """A few AdamW steps on random tokens, so every weight (norm gains too) differs from its init."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        tokens = torch.randint(0, model.cfg.vocab_size, (1, seq_len + 1), generator=g)
        loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab-size", type=int, default=256, help="256: the byte tokenizer's; a BPE's is larger")
    parser.add_argument("--tokens", type=int, default=256, help="sequence length compared (at most 1024)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--train-steps", type=int, default=2, help="AdamW steps before the export (0: at init)")
    parser.add_argument("--device", default="cpu", help="where both models compute the logits")
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args()

    model_cfg = ModelConfig(vocab_size=args.vocab_size, d_model=768, n_layers=12, n_heads=12, max_seq_len=1024)
    if not 1 <= args.tokens <= model_cfg.max_seq_len:
        parser.error(f"--tokens must be in [1, {model_cfg.max_seq_len}]")
    cfg = SwarmConfig(model=model_cfg, stages=StagesConfig(num_stages=4))
    timings: dict[str, float] = {}
    model = timed(timings, "build_s", lambda: Transformer(model_cfg))
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e6:.1f}M parameters (d_model 768, 12 layers, 12 heads, vocab {args.vocab_size})")
    timed(timings, "train_s", lambda: off_init(model, args.train_steps, min(args.tokens, 128), seed=1))
    tokens = torch.randint(0, args.vocab_size, (args.batch, args.tokens), generator=torch.Generator().manual_seed(2))

    with tempfile.TemporaryDirectory() as tmp:
        checkpoint, folder = Path(tmp) / "model.pt", Path(tmp) / "hf"
        timed(timings, "save_checkpoint_s", lambda: save_checkpoint(checkpoint, cfg, model, steps=args.train_steps))
        timed(timings, "export_hf_s", lambda: export_checkpoint(checkpoint, folder, format="hf", on_progress=print))
        safetensors_mb = (folder / "model.safetensors").stat().st_size / 1e6
        hf = timed(
            timings, "load_transformers_s", lambda: LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
        )
    model, hf, tokens = model.to(args.device).eval(), hf.to(args.device).eval(), tokens.to(args.device)
    with torch.no_grad():
        ours = timed(timings, "forward_swarmloco_s", lambda: model(tokens))
        theirs = timed(timings, "forward_transformers_s", lambda: hf(tokens).logits)
    max_abs_diff = (ours - theirs).abs().max().item()
    result = {
        "model": {"d_model": 768, "n_layers": 12, "n_heads": 12, "vocab_size": args.vocab_size, "params": params},
        "tokens": [args.batch, args.tokens],
        "train_steps": args.train_steps,
        "device": str(tokens.device),
        "safetensors_MB": round(safetensors_mb, 1),
        "max_abs_logit_diff": max_abs_diff,
        "logit_scale": ours.abs().max().item(),
        "tolerance": TOLERANCE,
        "ok": max_abs_diff <= TOLERANCE,
        "timings": timings,
    }
    print(
        f"max |logits(swarmloco) - logits(transformers)| = {max_abs_diff:.2e} over {args.batch}×{args.tokens} tokens "
        f"(bound {TOLERANCE:.0e}: {'ok' if result['ok'] else 'EXCEEDED'})"
    )
    print("timings: " + ", ".join(f"{step} {seconds:.2f}" for step, seconds in timings.items()))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
