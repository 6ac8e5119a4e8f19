"""A real local swarm against the centralized baseline at the same tokens, run back to back.

The swarm is ``swarmloco local``: one trainer and one stage server per middle stage, each a
separate process with its own DHT node, talking over loopback through libp2p with the swarm's
codecs. The baseline trains the same seeded model in this process on the same data stream (the
trainer's) for the same number of inner steps, and both are evaluated on the same held-out
batches. Bytes are the trainer's wire-frame counters; ``fp32_bytes_per_token`` is what the same
tensors would have cost as raw fp32, from the same run.

    python scripts/bench_swarm.py --json bench-swarm.json            # ~4 min on 2 cores
    python scripts/bench_swarm.py --steps 30 --codec fp32             # quick look, fp32 on the wire
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from peer.data import load_corpus
from peer.launch import VAL_BATCHES, LocalSwarm, launch_local, local_config
from swarm.centralized import train_centralized
from swarm.config import SwarmConfig, load_config

TARGET_LOSS_GAP = 0.05  # swarm val loss within 5% of the baseline's
TARGET_COMPRESSION = 4.0  # wire bytes per token at least 4× below fp32


def run_swarm(cfg: SwarmConfig, layout: LocalSwarm, data: list[str] | None, out: Path) -> dict[str, Any]:
    started = time.perf_counter()
    code = launch_local(layout, out=out, config=cfg, data=data)
    if code != 0:
        raise SystemExit(f"the swarm failed (exit {code}); logs in {out}")
    last = json.loads((out / "trainer-0.jsonl").read_text().splitlines()[-1])
    tokens = last["tokens"]
    training = ("activations", "gradients")  # validation traffic is counted apart ("eval"), not per training token
    wire, fp32 = last["wire_bytes"], last["fp32_bytes"]
    return {
        "val_loss": last["val_loss"],
        "tokens": tokens,
        "tokens_per_s": last["tokens_per_s"],  # while training, startup excluded
        "wall_s": time.perf_counter() - started,  # startup and shutdown of every process included
        "bytes_per_token": {kind: wire[kind] / tokens for kind in training} | {"total": sum(wire[k] for k in training) / tokens},
        "fp32_bytes_per_token": {kind: fp32[kind] / tokens for kind in training} | {"total": sum(fp32[k] for k in training) / tokens},
        "failed_hops": last["hop_failures"] + last["hop_timeouts"] + sum(v for k, v in last.items() if k.startswith("hop_refused_")),
        "skipped_hops": last["skipped_hops"],
        "resent_inputs": last["resent_inputs"],
        "microbatches": {k: last[k] for k in ("started", "completed", "failed", "cancelled")},
        "unaccounted_microbatches": last["started"] - last["completed"] - last["failed"] - last["cancelled"],
    }


def run_baseline(cfg: SwarmConfig, steps: int, data: list[str] | None) -> dict[str, Any]:
    torch.set_num_threads(1)  # as each swarm peer
    corpus = load_corpus(data)
    kw = dict(batch_size=cfg.train.microbatch_size, seq_len=cfg.train.seq_len)
    batches = corpus.sample_batches("train", seed=cfg.train.seed, **kw)  # trainer-0's stream
    val = corpus.val_batches(num_batches=VAL_BATCHES, **kw)
    log: list[dict[str, float]] = []
    train_centralized(cfg, batches, val, steps=steps, log_every=steps, on_log=log.append)
    return {"val_loss": log[-1]["val_loss"], "tokens": log[-1]["tokens"], "tokens_per_s": log[-1]["tokens"] / log[-1]["elapsed_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100, help="inner steps (each train.inner_batch samples)")
    parser.add_argument("--stages", type=int, default=2, help="middle stages, one server each")
    parser.add_argument("--codec", help="activation and gradient codec (default: the config's)")
    parser.add_argument("--config", type=Path, help="swarm config TOML (default: the built-in model)")
    parser.add_argument("--data", action="append", help="corpus files/dirs/globs (default: the stdlib sources)")
    parser.add_argument("--out", type=Path, help="keep the swarm's logs and metrics here")
    parser.add_argument("--json", type=Path, help="write the result here")
    args = parser.parse_args()

    layout = LocalSwarm(peers=args.stages + 1, stages=args.stages, trainers=1, steps=args.steps)
    cfg = local_config(load_config(args.config) if args.config else SwarmConfig(), layout)
    if args.codec:
        cfg = dataclasses.replace(cfg, codecs=dataclasses.replace(cfg.codecs, activations=args.codec, gradients=args.codec))
    with tempfile.TemporaryDirectory(prefix="bench-swarm-") as tmp:
        swarm = run_swarm(cfg, layout, args.data, args.out or Path(tmp))
    baseline = run_baseline(cfg, args.steps, args.data)
    assert swarm["tokens"] == baseline["tokens"], (swarm["tokens"], baseline["tokens"])

    gap = swarm["val_loss"] / baseline["val_loss"] - 1
    compression = swarm["fp32_bytes_per_token"]["total"] / swarm["bytes_per_token"]["total"]
    result = {
        "peers": layout.peers, "stages": layout.stages, "steps": args.steps, "tokens": swarm["tokens"], "config_hash": cfg.hash(),
        "codecs": {"activations": cfg.codecs.activations, "gradients": cfg.codecs.gradients},
        "model": dataclasses.asdict(cfg.model), "train": dataclasses.asdict(cfg.train),
        "tokens_per_s": swarm["tokens_per_s"], "baseline_tokens_per_s": baseline["tokens_per_s"],
        "val_loss": swarm["val_loss"], "baseline_val_loss": baseline["val_loss"], "val_loss_gap": gap,
        "compression_vs_fp32": compression,
        **{k: v for k, v in swarm.items() if k not in ("val_loss", "tokens", "tokens_per_s")},
        "targets": {"val_loss_within_5pct": gap <= TARGET_LOSS_GAP, "bytes_4x_below_fp32": compression >= TARGET_COMPRESSION,
                    "no_unaccounted_microbatches": swarm["unaccounted_microbatches"] == 0},
    }
    print(f"swarm    val {swarm['val_loss']:.4f}  {swarm['tokens_per_s']:.0f} tok/s  {swarm['bytes_per_token']['total']:.0f} B/token "
          f"({compression:.1f}x below fp32)  failed hops {swarm['failed_hops']}  skipped {swarm['skipped_hops']}")
    print(f"baseline val {baseline['val_loss']:.4f}  {baseline['tokens_per_s']:.0f} tok/s   gap {100 * gap:+.2f}%   targets {result['targets']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
