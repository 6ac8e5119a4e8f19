"""Presets that train (issue 33): train-local curves of the model presets on their own inner-optimizer defaults, and an
lr sweep around one preset's default.

Each run is ``swarmloco train-local``'s training (``train_centralized`` on the config ``follow_run`` gives it: the
preset's ``[inner]`` defaults, the cosine as long as the run) on the default corpus, in one process with ``--threads``
torch threads, one run at a time. Along the way it logs each logged step's train loss and a probe loss on one fixed
held-out batch (cheap enough to log often); at the end, the validation loss over ``--val-sequences`` held-out windows.

- curves (``--curves``, seed 0): does the loss fall below ln(vocab) = ln 256 = 5.55 (a uniform guess over bytes), and
  does it keep falling (the probe's last point below its point at half the run)?
- the sweep (``--sweep``): the preset's default lr times each ``--scales`` factor, ``--seeds`` seeds each (seeds vary
  the data order and the initial weights); the scales ranked by their mean final validation loss: is the default
  (×1) within the best two? Its ×1 runs are curves of that preset on its defaults too.

    python scripts/bench_presets.py --json docs/data/presets.json             # the issue's runs (about an hour on 1 thread)
    python scripts/bench_presets.py --curves 20m=5 --sweep none --seeds 0      # a quick look
    python scripts/bench_presets.py --curves --seeds 2 --add-to docs/data/presets.json --json docs/data/presets.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from peer.data import Corpus, load_corpus
from swarm.cli_fields import add_field_arguments
from swarm.config import SwarmConfig, derive_config, follow_run
from swarm.model.sizing import model_parameters
from swarm.sim.centralized import evaluate, train_centralized

LN_VOCAB = math.log(256)  # the byte tokenizer: a uniform guess's loss
HEADER = (
    f"{'run':<22} {'params':>7} {'seq':>4} {'lr':>8} {'warm':>4} {'steps':>5} {'tokens':>7} {'s/step':>6} "
    f"{'<5.55 at':>8} {'probe half→end':>14} {'val end':>7}"
)


def run(
    preset: str, corpus: Corpus, args: argparse.Namespace, *, steps: int, seq_len: int, seed: int, lr_scale: float
) -> dict[str, Any]:
    """One train-local run of ``preset`` on its defaults (its lr × ``lr_scale``); its logged curve and final losses."""
    base = derive_config(
        SwarmConfig(),
        {
            "model.preset": preset,
            "train.seq_len": seq_len,
            "train.microbatch_size": args.microbatch,
            "train.inner_batch": args.inner_batch,
            "train.seed": seed,
            "model.init_seed": seed,
        },
    )
    if lr_scale != 1.0:
        base = derive_config(base, {"inner.lr": base.inner.lr * lr_scale})
    cfg = follow_run(base, steps, schedule_set=False)  # what train-local --steps does with a config that leaves it out
    torch.manual_seed(cfg.train.seed)
    batches = corpus.sample_batches("train", batch_size=args.microbatch, seq_len=seq_len, seed=seed)
    probe = corpus.val_batches(batch_size=args.microbatch, seq_len=seq_len, num_sequences=args.microbatch)
    val = corpus.val_batches(batch_size=args.microbatch, seq_len=seq_len, num_sequences=args.val_sequences)
    log: list[dict[str, float]] = []

    def on_log(record: dict[str, float]) -> None:
        log.append({k: record[k] for k in ("step", "tokens", "train_loss", "val_loss", "elapsed_s", "lr")})
        print(
            f"  {preset} ×{lr_scale:g} seed {seed}: step {int(record['step'])}/{steps} train {record['train_loss']:.3f} "
            f"probe {record['val_loss']:.3f} lr {record['lr']:.2e} {record['elapsed_s']:.0f}s",
            flush=True,
        )

    started = time.perf_counter()
    model = train_centralized(cfg, batches, probe, steps=steps, log_every=args.log_every, on_log=on_log)
    train_s = time.perf_counter() - started
    model.eval()
    val_loss = evaluate(model, val)
    probes = [r["val_loss"] for r in log]
    below = next((r["step"] for r in log if r["val_loss"] < LN_VOCAB), None)
    half = next(r["val_loss"] for r in log if r["step"] >= steps / 2)
    return {
        "preset": preset,
        "parameters": model_parameters(cfg.model),
        "seq_len": seq_len,
        "lr": cfg.inner.lr,
        "lr_scale": lr_scale,
        "warmup_steps": cfg.inner.warmup_steps,
        "total_steps": cfg.inner.total_steps,
        "seed": seed,
        "steps": steps,
        "tokens": log[-1]["tokens"],
        "step_s": log[-1]["elapsed_s"] / steps,  # probe passes included (one batch per logged step)
        "train_s": train_s,
        "below_ln_vocab_at_step": below,
        "probe_half": half,
        "probe_end": probes[-1],
        "val_loss": val_loss,
        "val_sequences": args.val_sequences,
        "keeps_falling": probes[-1] < half and below is not None,
        "log": log,
    }


def row(name: str, r: dict[str, Any]) -> str:
    below = str(int(r["below_ln_vocab_at_step"])) if r["below_ln_vocab_at_step"] is not None else "never"
    return (
        f"{name:<22} {r['parameters'] / 1e6:>6.1f}M {r['seq_len']:>4} {r['lr']:>8.2e} {r['warmup_steps']:>4} "
        f"{r['steps']:>5} {r['tokens']:>7} {r['step_s']:>6.2f} {below:>8} "
        f"{r['probe_half']:>6.3f}→{r['probe_end']:<7.3f} {r['val_loss']:>7.4f}"
    )


def sweep_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per lr scale: mean and sample std of the final validation loss over seeds; the scales ranked; the default's rank."""
    scales = sorted({r["lr_scale"] for r in runs})
    points = []
    for scale in scales:
        losses = [r["val_loss"] for r in runs if r["lr_scale"] == scale]
        points.append(
            {
                "lr_scale": scale,
                "lr": next(r["lr"] for r in runs if r["lr_scale"] == scale),
                "seeds": len(losses),
                "val_loss_mean": statistics.fmean(losses),
                "val_loss_std": statistics.stdev(losses) if len(losses) > 1 else None,
                "val_losses": losses,
            }
        )
    ranked = sorted(points, key=lambda p: p["val_loss_mean"])
    rank = next((i + 1 for i, p in enumerate(ranked) if p["lr_scale"] == 1.0), None)
    return {"points": points, "ranking": [p["lr_scale"] for p in ranked], "default_rank": rank}


def parse_curves(specs: list[str]) -> list[tuple[str, int, int]]:
    """``PRESET=STEPS[@SEQ_LEN]`` items as (preset, steps, seq_len or 0 for --seq-len)."""
    curves = []
    for spec in specs:
        preset, _, rest = spec.partition("=")
        steps, _, seq = rest.partition("@")
        curves.append((preset, int(steps), int(seq or 0)))
    return curves


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--curves",
        nargs="*",
        default=["125m=40@128"],
        help="PRESET=STEPS[@SEQ_LEN] train-local curves on the preset's defaults",
    )
    parser.add_argument("--sweep", default="20m", help="the preset whose lr is swept ('none': no sweep)")
    parser.add_argument("--scales", type=float, nargs="+", default=[1 / 3, 1.0, 3.0], help="× the preset's lr")
    parser.add_argument("--sweep-steps", type=int, default=80)
    parser.add_argument("--sweep-seq-len", type=int, default=128)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="the sweep's seeds (curves: seed 0)")
    shape = {"train.seq_len": 256, "train.microbatch_size": 8, "train.inner_batch": 8}  # seq_len: a curve's own first
    add_field_arguments(parser, SwarmConfig, *shape, defaults=shape)
    parser.add_argument("--log-every", type=int, default=5, help="log train and probe loss every N steps")
    parser.add_argument("--val-sequences", type=int, default=64, help="held-out windows of the final validation loss")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument(
        "--add-to", type=Path, help="an earlier --json file whose runs these join (more seeds, another curve)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    corpus = load_corpus(None)
    started = time.perf_counter()
    earlier = json.loads(args.add_to.read_text()) if args.add_to else {}
    curves: list[dict[str, Any]] = earlier.get("curves", [])
    sweep_runs: list[dict[str, Any]] = (earlier.get("sweep") or {}).get("runs", [])
    before = earlier.get("commands") or ([earlier["command"]] if "command" in earlier else [])
    args.commands = [*before, " ".join(["python", *sys.argv])]
    args.earlier_wall_s = earlier.get("wall_s", 0.0)
    for preset, steps, seq in parse_curves(args.curves):
        curves.append(run(preset, corpus, args, steps=steps, seq_len=seq or args.seq_len, seed=0, lr_scale=1.0))
        report(args, curves, sweep_runs, started)
    if args.sweep != "none":
        for seed in args.seeds:  # seed by seed: a run cut short still has whole seeds
            for scale in args.scales:
                sweep_runs.append(
                    run(
                        args.sweep,
                        corpus,
                        args,
                        steps=args.sweep_steps,
                        seq_len=args.sweep_seq_len,
                        seed=seed,
                        lr_scale=scale,
                    )
                )
                report(args, curves, sweep_runs, started)


def report(
    args: argparse.Namespace, curves: list[dict[str, Any]], sweep_runs: list[dict[str, Any]], started: float
) -> None:
    """The table of the runs so far, and the JSON (written after every run, so a run cut short keeps what it has)."""
    print(HEADER)
    for r in curves:
        print(row(f"curve {r['preset']}", r))
    for r in sweep_runs:
        print(row(f"sweep {r['preset']} ×{r['lr_scale']:.2g} s{r['seed']}", r))
    summary = sweep_summary(sweep_runs) if sweep_runs else None
    if summary:
        for p in summary["points"]:
            std = f" ± {p['val_loss_std']:.4f}" if p["val_loss_std"] is not None else ""
            print(
                f"sweep {args.sweep} lr {p['lr']:.2e} (×{p['lr_scale']:.2g}): val {p['val_loss_mean']:.4f}{std} "
                f"over {p['seeds']} seed(s)"
            )
        ranking = " ".join(f"×{s:.2g}" for s in summary["ranking"])
        print(f"ranking (best first): {ranking}; the default is #{summary['default_rank']}")
    load = os.getloadavg()
    wall_s = args.earlier_wall_s + time.perf_counter() - started  # of every command that made these runs
    print(f"{wall_s / 60:.1f} min; load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}; {os.cpu_count()} CPUs")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        result = {
            "args": {k: str(v) for k, v in vars(args).items() if k not in ("commands", "earlier_wall_s")},
            "commands": args.commands,
            "load": load,
            "wall_s": wall_s,
            "curves": curves,
            "sweep": {"runs": sweep_runs, **summary} if summary else None,
        }
        args.json.write_text(json.dumps(result, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
