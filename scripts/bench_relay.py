"""Frames sent server to server (``--relay``) against the trainer's path, on loopback with real hivemind peers: the
trainer's bytes per token on its link (boundary frames, both directions), what each stage server's link carried, and
tokens/s (uncapped loopback: the compute's pace on this machine), one microbatch at a time through S middle stages.

    python scripts/bench_relay.py --json docs/data/relay_bytes.json                       # 125m width, 8 × 1024
    python scripts/bench_relay.py --d-model 64 --seq-len 64 --stages 3 --microbatches 8    # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

import torch

from compress.config import CodecConfig
from swarm.cli_fields import add_field_arguments
from swarm.config import SwarmConfig, TrainerOptions
from swarm.pipeline.trainer import Trainer
from swarmtest.configs import tiny_config
from swarmtest.relay import RelayLab

BOUNDARY = ("activations", "gradients")


async def measure(args: argparse.Namespace, relay: bool) -> dict[str, Any]:
    cfg = tiny_config(
        stages=args.stages,
        model={
            "d_model": args.d_model,
            "n_layers": args.stages,
            "n_heads": max(1, args.d_model // 64),
            "max_seq_len": args.seq_len,
        },
        train={"seq_len": args.seq_len, "microbatch_size": args.batch, "inner_batch": args.batch},
        codecs=CodecConfig(activations=args.codec, gradients=args.codec),
        outer={"method": "none"},
    )
    torch.manual_seed(0)
    async with RelayLab(cfg, {f"s{s}": s for s in range(1, args.stages + 1)}) as lab:
        options = TrainerOptions(in_flight=1, relay=relay, check_rate=0.0, probe_rate=0.0)
        trainer = Trainer(cfg, lab.client, lab.router, options=options)
        lab.router.draw_path = lambda paths: list(range(1, args.stages + 1))  # type: ignore[method-assign]
        tokens = torch.randint(0, 256, (args.microbatches + 1, args.batch, args.seq_len))
        try:
            await trainer.train_microbatch(tokens[0], tokens[0])  # warm-up: dials, first allocations
            before = sum((trainer.traffic.sent + trainer.traffic.received)[k] for k in BOUNDARY)
            servers_before = {n: sum((p.traffic.sent + p.traffic.received).values()) for n, p in lab.peers.items()}
            started = time.perf_counter()
            losses = [await trainer.train_microbatch(x, x) for x in tokens[1:]]
            elapsed = time.perf_counter() - started
        finally:
            await trainer.remote.close()
            trainer.shutdown()
        n_tokens = args.microbatches * args.batch * args.seq_len
        trainer_bytes = sum((trainer.traffic.sent + trainer.traffic.received)[k] for k in BOUNDARY) - before
        servers = {
            n: (sum((p.traffic.sent + p.traffic.received).values()) - servers_before[n]) / n_tokens
            for n, p in lab.peers.items()
        }
        return {
            "relay": relay,
            "failed": losses.count(None),
            "trainer_bytes_per_token": trainer_bytes / n_tokens,
            "server_bytes_per_token": servers,
            "tokens_per_s": n_tokens / elapsed,
            "counters": {k: v for k, v in trainer.counters.items() if v},
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=3)
    add_field_arguments(parser, SwarmConfig, "codecs.activations", flags={"codecs.activations": ("--codec",)})
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = [asyncio.run(measure(args, relay)) for relay in (False, True)]
    print(f"{'route':<8} {'trainer B/token':>16} {'servers B/token':>24} {'tokens/s':>9}")
    for row in rows:
        servers = ", ".join(f"{v:.0f}" for v in row["server_bytes_per_token"].values())
        print(
            f"{'relay' if row['relay'] else 'trainer':<8} {row['trainer_bytes_per_token']:>16.0f} {servers:>24} "
            f"{row['tokens_per_s']:>9.1f}"
        )
    ratio = rows[1]["trainer_bytes_per_token"] / rows[0]["trainer_bytes_per_token"]
    print(f"trainer's link: {ratio:.3f} of the trainer's path's bytes (1/S = {1 / args.stages:.3f})")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
