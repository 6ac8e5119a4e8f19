"""Does zstd pay on int8 boundary frames? Its ratio and time on real activations and gradients at 125m shapes.

The 125m preset's embedding and first block (a 12-stage split: one block per middle stage) take microbatches of the
default corpus (the stdlib sources, byte tokens) at seq 1024, microbatch 8, and a few AdamW steps (``--steps``); the
last microbatch's four boundary tensors (the embedding and the block's output, the loss gradient at the block's output
and at the embedding) are int8-coded, and each row says what zstd makes of the frame's body: compressed / raw bytes,
and the encode time without zstd (quantise and frame) and with it, medians over ``--repeats``. ``zstd`` is what the
wire now does with the frame (``compress/wire.py``: only where it saves ≥ 10%).

    python scripts/bench_wire_zstd.py --json bench_wire_zstd.json   # ~1 minute on 2 CPU cores
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import zstandard

from compress.codecs import get_codec
from compress.wire import ZSTD_LEVEL, CodecId, encode_frame, raw_frame_bytes
from peer.data import load_corpus
from swarm.cli_fields import add_field_arguments
from swarm.config import SwarmConfig
from swarm.model.stages import build_stage
from swarm.model.step import microbatch_loss
from swarm.model.transformer import PRESETS, ModelConfig


@dataclass
class Row:
    tensor: str
    shape: tuple[int, ...]
    raw_bytes: int  # the int8 frame's body
    zstd_bytes: int
    ratio: float  # zstd / raw
    encode_ms: float  # quantise and frame, body raw
    encode_zstd_ms: float  # quantise and frame, zstd tried (kept where it pays)
    unzstd_ms: float  # decompressing the body
    zstd_used: bool  # what the wire does with this frame


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def boundary_tensors(steps: int, seq: int, micro: int, blocks: int) -> dict[str, torch.Tensor]:
    """The four boundary tensors of the last of ``steps + 1`` microbatches through the 125m embedding and its first
    ``blocks`` blocks (one middle stage), the head right after them."""
    cfg = ModelConfig(**PRESETS["125m"])
    edge, middle = build_stage(cfg, cfg.n_layers // blocks, 0), build_stage(cfg, cfg.n_layers // blocks, 1)
    opt = torch.optim.AdamW([*edge.parameters(), *middle.parameters()], lr=6e-4)
    batches = load_corpus().sample_batches("train", batch_size=micro, seq_len=seq, seed=0)
    kinds = ["embedding", f"block {blocks} out", f"grad at block {blocks} out", "grad at embedding"]
    seen: dict[str, torch.Tensor] = {}  # filled in the order the step sends them

    def capture(kind: str, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        seen[kinds[len(seen)]] = x.detach().clone()
        return x.detach()

    for step in range(steps + 1):
        seen.clear()
        microbatch_loss(edge, [middle], next(batches), inner_batch=micro, send=capture)
        if step < steps:
            opt.step()
            opt.zero_grad(set_to_none=True)
    return seen


def measure(name: str, x: torch.Tensor, repeats: int) -> Row:
    int8 = get_codec("int8")
    body = int8.pack(x)[1]
    packed = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(body)

    def encode(compress: bool) -> bytes:
        meta, body = int8.pack(x)
        return encode_frame(CodecId.INT8, body, dtype=x.dtype, shape=tuple(x.shape), meta=meta, compress=compress)

    return Row(
        tensor=name,
        shape=tuple(x.shape),
        raw_bytes=len(body),
        zstd_bytes=len(packed),
        ratio=len(packed) / len(body),
        encode_ms=median_ms(lambda: encode(False), repeats),
        encode_zstd_ms=median_ms(lambda: encode(True), repeats),
        unzstd_ms=median_ms(lambda: zstandard.ZstdDecompressor().decompress(packed), repeats),
        zstd_used=raw_frame_bytes(encode(True)) != len(encode(True)),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2, help="AdamW steps before the measured microbatch")
    shape = {"train.seq_len": 1024, "train.microbatch_size": 8}  # 125m's
    flags = {"train.seq_len": ("--seq",), "train.microbatch_size": ("--micro",)}
    add_field_arguments(parser, SwarmConfig, *shape, defaults=shape, flags=flags)
    parser.add_argument("--blocks", type=int, default=1, choices=(1, 2, 3, 4, 6, 12), help="blocks before the boundary")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.manual_seed(0)
    started = time.perf_counter()
    rows = [
        measure(n, x, args.repeats) for n, x in boundary_tensors(args.steps, args.seq, args.micro, args.blocks).items()
    ]
    print(f"int8 frames at 125m, microbatch {args.micro} x {args.seq}, after {args.steps} AdamW steps")
    print(f"{'tensor':<22}{'raw MB':>8}{'zstd/raw':>10}{'encode ms':>11}{'with zstd':>11}{'unzstd ms':>11}  zstd kept")
    for r in rows:
        print(
            f"{r.tensor:<22}{r.raw_bytes / 1e6:>8.2f}{r.ratio:>10.3f}{r.encode_ms:>11.1f}"
            f"{r.encode_zstd_ms:>11.1f}"
            f"{r.unzstd_ms:>11.1f}  {'yes' if r.zstd_used else 'no'}"
        )
    print(f"({time.perf_counter() - started:.0f} s)")
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=2))


if __name__ == "__main__":
    main()
