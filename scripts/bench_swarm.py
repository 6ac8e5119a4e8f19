"""A real local swarm against the centralized baseline at the same tokens, run back to back.

The swarm is ``swarmloco local``: trainers and stage servers (``--replicas`` per middle stage),
each a separate process with its own DHT node, talking over loopback through libp2p with the
swarm's codecs; the replicas of each stage meet every H inner steps for an outer step
(``--outer``). With ``--join`` one more peer starts mid-run with ``--role auto``: it takes the
role the swarm needs, downloads its stage's state and starts serving. The baseline trains the
same seeded model in this process on trainer-0's data stream for as many tokens as all trainers
together, and both are evaluated on the same held-out batches.

Bytes are the peers' own counters. ``fp32_bytes_per_token`` is what the same activation tensors
would have cost as raw fp32; ``fp32_pseudo_grad_bytes_per_token`` what the same outer-step
transfers would have cost as dense fp32 pseudo-gradients (DiLoCo with fp32 exchange), both from
the same run.

    python scripts/bench_swarm.py --json bench-swarm.json                                   # ~4 min on 2 cores
    python scripts/bench_swarm.py --outer sparseloco --trainers 2 --replicas 2 --stages 1 --join --json bench-outer.json
    python scripts/bench_swarm.py --steps 30 --codec fp32                                   # quick look, fp32 on the wire
    python scripts/bench_swarm.py --seeds 3 --json docs/data/bench-local-default.json       # the default `swarmloco local` vs train-local
    python scripts/bench_swarm.py --trainers 2 --stages 3 --seeds 3 --in-flight 4 --max-staleness 0 \
        --set train.microbatch_size=4 --json docs/data/window-loss-mb4.json             # 4 microbatches per inner step
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

from peer.data import load_corpus
from peer.launch import LocalSwarm, local_config
from swarm.cli_fields import add_field_arguments, from_arguments
from swarm.config import SwarmConfig, TrainerOptions, parse_overrides
from swarm.config_toml import load_config
from swarm.node.config import PeerConfig
from swarm.sim.centralized import train_centralized
from swarmtest.bench import bench_config, run_swarm

TARGET_LOSS_GAP = 0.05  # swarm val loss within 5% of the baseline's
TARGET_COMPRESSION = 4.0  # activation bytes per token at least 4× below fp32
TARGET_PSEUDO_GRAD_COMPRESSION = 100.0  # pseudo-gradient bytes at least 100× below dense fp32 (SparseLoCo)
TARGET_JOIN_S = 30.0  # a late peer serves its first request within 30 s of its start
LAYOUT_FIELDS = ("steps", "stages", "trainers", "join_after_s")  # LocalSwarm's, as options (peer/local_swarm.py)
WINDOW_FIELDS = ("in_flight", "max_staleness")  # TrainerOptions', as options (swarm/config.py)


def run_baseline(cfg: SwarmConfig, steps: int, data: list[str] | None) -> dict[str, Any]:
    torch.set_num_threads(1)  # as each swarm peer
    corpus = load_corpus(data)
    kw = dict(batch_size=cfg.train.microbatch_size, seq_len=cfg.train.seq_len)
    batches = corpus.sample_batches("train", seed=cfg.train.seed, **kw)  # trainer-0's stream
    val = corpus.val_batches(**kw)
    log: list[dict[str, float]] = []
    cfg = dataclasses.replace(cfg, inner=dataclasses.replace(cfg.inner, total_steps=steps))
    train_centralized(cfg, batches, val, steps=steps, log_every=steps, on_log=log.append)
    return {
        "val_loss": log[-1]["val_loss"],
        "tokens": log[-1]["tokens"],
        "tokens_per_s": log[-1]["tokens"] / log[-1]["elapsed_s"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_field_arguments(parser, LocalSwarm, *LAYOUT_FIELDS[:3])
    parser.add_argument("--replicas", type=int, default=1, help="stage servers per middle stage")
    # the config's unless given (diloco exchanges fp32); -H/--inner-steps, the field's own names
    config_fields = {"outer.method": None, "outer.inner_steps": None}
    add_field_arguments(
        parser, SwarmConfig, *config_fields, defaults=config_fields, flags={"outer.method": ("--outer",)}
    )
    parser.add_argument("--join", action="store_true", help="start one more peer mid-run with --role auto")
    add_field_arguments(parser, LocalSwarm, LAYOUT_FIELDS[3])
    add_field_arguments(  # activations and gradients; the config's unless given
        parser,
        SwarmConfig,
        "codecs.activations",
        defaults={"codecs.activations": None},
        flags={"codecs.activations": ("--codec",)},
    )
    parser.add_argument("--config", type=Path, help="swarm config TOML (default: the built-in model)")
    add_field_arguments(parser, PeerConfig, "data")
    parser.add_argument("--out", type=Path, help="keep the swarm's logs and metrics here")
    parser.add_argument(
        "--seeds",
        type=int,
        default=1,
        help="repeat with train.seed 0..N-1 (data order, routing) and report mean and spread",
    )
    parser.add_argument(
        "--first-seed", type=int, default=0, help="the first train.seed of --seeds (more seeds of an earlier run)"
    )
    # None: the trainers' own (the record says so)
    add_field_arguments(parser, TrainerOptions, *WINDOW_FIELDS, defaults=dict.fromkeys(WINDOW_FIELDS))
    parser.add_argument(
        "--set",
        nargs="+",
        default=[],
        metavar="PATH=VALUE",
        help="config overrides for the swarm and the baseline (e.g. train.microbatch_size=4: four microbatches per "
        "inner step of 16)",
    )
    parser.add_argument("--json", type=Path, help="write the result here")
    args = parser.parse_args()

    layout = from_arguments(
        LocalSwarm,
        args,
        *LAYOUT_FIELDS,
        peers=args.trainers + args.replicas * args.stages,
        joiners=int(args.join),
    )
    try:
        cfg = bench_config(
            local_config(load_config(args.config) if args.config else SwarmConfig(), layout),
            args.outer,
            args.inner_steps,
            args.codec,
            parse_overrides(args.set),
        )
    except ValueError as e:  # a malformed --set pair, an unknown field, a value the config refuses
        parser.error(str(e))
    results = [
        measure(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seed=seed)), layout, args)
        for seed in range(args.first_seed, args.first_seed + args.seeds)
    ]
    if args.seeds > 1:
        print_seeds(results)
    if args.json:
        args.json.write_text(
            json.dumps(
                results[0] if args.seeds == 1 else {"seeds": args.seeds, "runs": results, **spread(results)}, indent=1
            )
        )
        print(f"wrote {args.json}")


def measure(cfg: SwarmConfig, layout: LocalSwarm, args: argparse.Namespace) -> dict[str, Any]:
    """One seed: the swarm, then the baseline on as many tokens; the comparison and the targets."""
    with tempfile.TemporaryDirectory(prefix="bench-swarm-") as tmp:
        out = args.out / f"seed{cfg.train.seed}" if args.out else Path(tmp)
        swarm = run_swarm(cfg, layout, args.data, out, trainer=from_arguments(TrainerOptions, args, *WINDOW_FIELDS))
    tokens_per_step = cfg.train.inner_batch * cfg.train.seq_len
    baseline = run_baseline(
        cfg, swarm["tokens"] // tokens_per_step, args.data
    )  # as many tokens as all trainers together
    assert swarm["tokens"] == baseline["tokens"], (swarm["tokens"], baseline["tokens"])

    gap = swarm["val_loss"] / baseline["val_loss"] - 1
    compression = swarm["fp32_bytes_per_token"]["total"] / swarm["bytes_per_token"]["total"]
    targets = {
        "val_loss_within_5pct": gap <= TARGET_LOSS_GAP,
        "bytes_4x_below_fp32": compression >= TARGET_COMPRESSION,
        "no_unaccounted_microbatches": swarm["unaccounted_microbatches"] == 0,
    }
    if cfg.outer.method == "sparseloco" and swarm["pseudo_grad_compression_vs_fp32"]:
        targets["pseudo_grads_100x_below_fp32"] = (
            swarm["pseudo_grad_compression_vs_fp32"] >= TARGET_PSEUDO_GRAD_COMPRESSION
        )
    if args.join:
        targets["join_within_30s"] = swarm.get("join_s") is not None and swarm["join_s"] <= TARGET_JOIN_S
    result = {
        "peers": layout.peers + layout.joiners,
        "stages": layout.stages,
        "trainers": layout.trainers,
        "replicas": args.replicas,
        "steps": args.steps,
        "seed": cfg.train.seed,
        "tokens": swarm["tokens"],
        "config_hash": cfg.hash(),
        "data": args.data,
        "codecs": {
            "activations": cfg.codecs.activations,
            "gradients": cfg.codecs.gradients,
            "pseudo_gradients": cfg.codecs.pseudo_gradients,
        },
        "outer": {
            "method": cfg.outer.method,
            "inner_steps": cfg.outer.inner_steps,
            "matchmaking_s": cfg.timeouts.matchmaking_s,
        },
        "model": dataclasses.asdict(cfg.model),
        "train": dataclasses.asdict(cfg.train),
        "in_flight": args.in_flight,
        "max_staleness": args.max_staleness,
        "tokens_per_s": swarm["tokens_per_s"],
        "baseline_tokens_per_s": baseline["tokens_per_s"],
        "val_loss": swarm["val_loss"],
        "baseline_val_loss": baseline["val_loss"],
        "val_loss_gap": gap,
        "compression_vs_fp32": compression,
        **{k: v for k, v in swarm.items() if k not in ("val_loss", "tokens", "tokens_per_s")},
        "targets": targets,
    }
    print(
        f"seed {cfg.train.seed}: swarm    val {swarm['val_loss']:.4f}  {swarm['tokens_per_s']:.0f} tok/s  {swarm['bytes_per_token']['total']:.0f} B/token "
        f"({compression:.1f}x below fp32)  failed hops {swarm['failed_hops']}  skipped {swarm['skipped_hops']}"
    )
    print(
        f"outer    {cfg.outer.method} H={cfg.outer.inner_steps}: rounds {swarm['outer_rounds']}  median {swarm['round_s'] or 0:.2f}s  "
        f"{swarm['pseudo_grad_bytes_per_token']:.3f} pseudo-grad B/token (fp32 would be {swarm['fp32_pseudo_grad_bytes_per_token']:.1f})"
        f"  window {swarm['window_mean'] or 0:.2f}, staleness {swarm['staleness_mean'] or 0:.2f} (trainers), "
        f"{swarm['server_stale_recompute_steps_mean'] or 0:.2f} steps (servers' recompute), "
        f"{swarm['server_stashed_backward_fraction'] or 0:.2f} of backwards on stashed weights"
        + (
            f"  joiner: {swarm['join_role']} of stage {swarm['join_stage']}, serving {swarm['join_s']:.1f}s after start"
            if swarm.get("join_s")
            else ""
        )
    )
    print(
        f"baseline val {baseline['val_loss']:.4f}  {baseline['tokens_per_s']:.0f} tok/s   gap {100 * gap:+.2f}%   targets {targets}",
        flush=True,
    )
    return result


def spread(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean and standard deviation over seeds of the swarm's and the baseline's validation loss, and of their ratio."""
    out = {}
    for key in ("val_loss", "baseline_val_loss", "val_loss_gap"):
        xs = [r[key] for r in results]
        out[key] = {"mean": statistics.mean(xs), "stdev": statistics.stdev(xs) if len(xs) > 1 else 0.0}
    return out


def print_seeds(results: list[dict[str, Any]]) -> None:
    print(f"\n{'seed':>4} {'swarm val':>9} {'baseline val':>12} {'gap':>7}")
    for r in results:
        print(f"{r['seed']:>4} {r['val_loss']:9.4f} {r['baseline_val_loss']:12.4f} {100 * r['val_loss_gap']:+6.2f}%")
    s = spread(results)
    print(
        f"mean {s['val_loss']['mean']:9.4f} {s['baseline_val_loss']['mean']:12.4f} {100 * s['val_loss_gap']['mean']:+6.2f}%"
        f"   (stdev {s['val_loss']['stdev']:.4f} / {s['baseline_val_loss']['stdev']:.4f} / {100 * s['val_loss_gap']['stdev']:.2f} pt)"
    )


if __name__ == "__main__":
    main()
