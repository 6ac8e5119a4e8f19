"""Convergence study: validation loss against tokens and bytes sent, for a list of rows, K replicas and seeds.

Every row at one K trains on the same tokens (``--steps`` inner steps per replica, each on
``train.inner_batch`` samples): the data-parallel baseline ("ddp": fp32 gradient all-reduce every
step, global batch K × inner_batch), one process on one replica's batch for K× the steps
("one-process"), and the outer methods (DiLoCo, SparseLoCo, NoLoCo) with their settings. Each
(row, K) is run for ``--seeds`` seeds and reported as the mean and sample std of the final
validation loss, its ratio to ddp and to one-process at the same K, and its pseudo-gradient bytes
per token against ddp's fp32 gradient bytes per token ("pg reduction").

    python scripts/bench_convergence.py --preset small --steps 500 --replicas 2 4 --seeds 3 \\
        --json bench-convergence.json --plot bench-convergence.png
    python scripts/bench_convergence.py --steps 500 --only ddp sparseloco   # the default model
    python scripts/bench_convergence.py --steps 2000 --replicas 2 --seeds 2 --only ddp sparseloco --jobs 4  # in parallel

Edit ``ROWS`` to change the study: each row is an outer method and dotted config overrides.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import importlib.util
import json
import multiprocessing
import statistics
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from peer.data import Corpus, load_corpus
from swarm.cli_fields import add_field_arguments
from swarm.config import ConfigValue, OuterChoice, SwarmConfig, derive_config, parse_overrides
from swarm.sim.centralized import train_centralized
from swarm.sim.simulate import Routing, SimulationConfig, simulate
from swarmtest.configs import STUDY_PRESETS

RowOuter = Literal["centralized"] | OuterChoice


@dataclass(frozen=True, kw_only=True)
class Row:
    name: str
    outer: RowOuter  # centralized: one process; ddp: gradient all-reduce every step; else the outer method
    overrides: Mapping[str, ConfigValue] = field(default_factory=dict)  # dotted config paths, via derive_config
    routing: Routing = "random"  # random: SWARM, any replica per hop; sticky: trainer k always uses replicas k


AVERAGE = {"outer.diloco_lr": 1.0, "outer.diloco_momentum": 0.0}  # the outer step is the plain replica mean

ROWS: list[Row] = [
    Row(name="ddp", outer="ddp"),
    Row(name="one-process", outer="centralized"),
    Row(name="diloco", outer="diloco"),  # the config's outer step (since the study: a plain average)
    Row(name="diloco/nesterov", outer="diloco", overrides={"outer.diloco_lr": 0.7, "outer.diloco_momentum": 0.9}),
    Row(name="diloco/avg", outer="diloco", overrides=AVERAGE),
    Row(name="sparseloco", outer="sparseloco"),
    Row(
        name="sparseloco/nesterov",
        outer="sparseloco",
        overrides={"outer.sparseloco_lr": 0.7, "outer.sparseloco_momentum": 0.9},
    ),
    # Nesterov with the default's long-run step (lr / (1 − momentum) = 1): momentum smooths Δ across rounds
    Row(
        name="sparseloco/nesterov0.5",
        outer="sparseloco",
        overrides={"outer.sparseloco_lr": 0.5, "outer.sparseloco_momentum": 0.5},
    ),
    Row(name="noloco", outer="noloco"),
    Row(name="diloco/lr2", outer="diloco", overrides=AVERAGE | {"outer.diloco_lr": 2.0}),
    Row(name="diloco/avg/inner-lr×2", outer="diloco", overrides=AVERAGE | {"inner.lr": 6e-3}),
    Row(name="diloco/avg/inner-lr÷2", outer="diloco", overrides=AVERAGE | {"inner.lr": 1.5e-3}),
    Row(name="diloco/avg/H1", outer="diloco", overrides=AVERAGE | {"outer.inner_steps": 1}),
    Row(name="diloco/avg/H5", outer="diloco", overrides=AVERAGE | {"outer.inner_steps": 5}),
    Row(name="diloco/avg/H10", outer="diloco", overrides=AVERAGE | {"outer.inner_steps": 10}),
    Row(name="sparseloco/H10", outer="sparseloco", overrides={"outer.inner_steps": 10}),
    Row(name="sparseloco/sticky", outer="sparseloco", routing="sticky"),  # no replica mixing between rounds
    Row(name="sparseloco/H50", outer="sparseloco", overrides={"outer.inner_steps": 50}),
    Row(name="sparseloco/k128", outer="sparseloco", overrides={"codecs.topk": 128}),  # 3.1% density
    Row(name="sparseloco/H10/k128", outer="sparseloco", overrides={"outer.inner_steps": 10, "codecs.topk": 128}),
    # a warm start: every step for the first N inner steps, then every H
    Row(name="diloco/warm50", outer="diloco", overrides={"outer.warm_start_steps": 50}),
    Row(name="sparseloco/warm20", outer="sparseloco", overrides={"outer.warm_start_steps": 20}),
    Row(name="sparseloco/warm50", outer="sparseloco", overrides={"outer.warm_start_steps": 50}),
    Row(name="sparseloco/warm100", outer="sparseloco", overrides={"outer.warm_start_steps": 100}),
    # SparseLoCo's error feedback: β of the buffer, and the outer step's size on the aggregated sparse Δ
    Row(name="sparseloco/ef0.9", outer="sparseloco", overrides={"codecs.error_decay": 0.9}),
    Row(name="sparseloco/ef0.99", outer="sparseloco", overrides={"codecs.error_decay": 0.99}),
    Row(name="sparseloco/ef1", outer="sparseloco", overrides={"codecs.error_decay": 1.0}),
    Row(name="sparseloco/lr1.5", outer="sparseloco", overrides={"outer.sparseloco_lr": 1.5}),
    Row(name="sparseloco/lr0.7", outer="sparseloco", overrides={"outer.sparseloco_lr": 0.7}),
    Row(name="sparseloco/lr2", outer="sparseloco", overrides={"outer.sparseloco_lr": 2.0}),
    # the inner AdamW against K: its peak lr and its warm-up (30 steps by default)
    Row(name="sparseloco/inner-lr×2", outer="sparseloco", overrides={"inner.lr": 6e-3}),
    Row(name="sparseloco/inner-lr÷2", outer="sparseloco", overrides={"inner.lr": 1.5e-3}),
    Row(name="sparseloco/warmup10", outer="sparseloco", overrides={"inner.warmup_steps": 10}),
    Row(name="sparseloco/warmup100", outer="sparseloco", overrides={"inner.warmup_steps": 100}),
]


def row_config(base: SwarmConfig, row: Row, *, codec: str, h: int, seed: int) -> SwarmConfig:
    """The row's swarm config: ``codec`` on activations (and their gradients), fp32 pseudo-gradients unless
    SparseLoCo (derive_config gives it its own), H = ``h`` unless the row sets it (0: the config's), seeded init.

        >>> row_config(SwarmConfig(), Row(name="x", outer="diloco"), codec="int8", h=10, seed=0).outer.inner_steps  # 10
    """
    overrides: dict[str, ConfigValue] = {
        "codecs.activations": codec,
        "codecs.pseudo_gradients": "fp32",
        "train.seed": seed,
        "model.init_seed": seed,  # replicas still start identical; seeds differ in init as well as data
    }
    if h:  # inert without an outer step, but keeps ddp's config the one `swarmloco simulate -H h` derives
        overrides["outer.inner_steps"] = h
    overrides |= row.overrides
    return derive_config(base, overrides, outer="ddp" if row.outer == "centralized" else row.outer)


def horizon(cfg: SwarmConfig, row: Row) -> int | None:
    """H of an outer row; None where there is no outer step."""
    return None if row.outer in ("centralized", "ddp") else cfg.outer.inner_steps


def run_one(
    row: Row, cfg: SwarmConfig, corpus: Corpus, *, replicas: int, steps: int, seed: int, log_points: int
) -> dict[str, Any]:
    """One training run of ``row`` at K = ``replicas``; the record the JSON keeps."""
    t = cfg.train
    val = corpus.val_batches(batch_size=t.microbatch_size, seq_len=t.seq_len)
    tokens = steps * replicas * t.inner_batch * t.seq_len  # the same for every row at this K
    ticks = tokens // (replicas * t.microbatch_size * t.seq_len)  # the simulator's ticks: K microbatches each
    log_every = max(1, ticks // log_points)
    started = time.perf_counter()
    if row.outer == "centralized":
        # a tick is K microbatches and a one-process step is one, so K× log_every lands on the same tokens
        result = run_centralized(cfg, corpus, val, tokens=tokens, seed=seed, log_every=log_every * replicas)
    else:
        result = run_simulated(
            cfg, corpus, val, row=row, replicas=replicas, tokens=tokens, seed=seed, log_every=log_every
        )
    return {
        "row": row.name,
        "outer": row.outer,
        "K": replicas,
        "H": horizon(cfg, row),
        "seed": seed,
        "wall_s": time.perf_counter() - started,
    } | result


def run_centralized(
    cfg: SwarmConfig, corpus: Corpus, val: list, *, tokens: int, seed: int, log_every: int
) -> dict[str, Any]:
    """One process on one replica's batch (microbatch_size), as many steps as the tokens take, its lr schedule fitted."""
    batch, seq_len = cfg.train.microbatch_size, cfg.train.seq_len
    steps = tokens // (batch * seq_len)
    cfg = dataclasses.replace(
        cfg,
        train=dataclasses.replace(cfg.train, inner_batch=batch),
        inner=dataclasses.replace(cfg.inner, total_steps=steps),
    )
    batches = corpus.sample_batches("train", batch_size=batch, seq_len=seq_len, seed=seed)
    log: list[dict[str, float]] = []
    train_centralized(cfg, batches, val, steps=steps, log_every=log_every, on_log=log.append)
    for record in log:
        record["bytes_per_token"] = 0.0  # nothing leaves the process
    return {"val_loss": log[-1]["val_loss"], "tokens": log[-1]["tokens"], "bytes_by_kind": {}, "log": log}


def run_simulated(
    cfg: SwarmConfig, corpus: Corpus, val: list, *, row: Row, replicas: int, tokens: int, seed: int, log_every: int
) -> dict[str, Any]:
    """The simulated swarm: ddp all-reduces gradients every step, the others run their outer step every H."""
    t = cfg.train
    streams = [
        corpus.sample_batches("train", batch_size=t.microbatch_size, seq_len=t.seq_len, seed=seed + 1000 * k)
        for k in range(replicas)
    ]
    sim = SimulationConfig(
        replicas=replicas,
        mode="ddp" if row.outer == "ddp" else "outer",
        routing=row.routing,
        tokens=tokens,
        seed=seed,
        log_every=log_every,
    )
    result = simulate(cfg, sim, streams, val)
    return {
        "val_loss": result.val_loss,
        "tokens": result.tokens,
        "outer_rounds": result.outer_rounds,
        "bytes_by_kind": result.bytes_by_kind,
        "log": result.log,
    }


def per_token(record: dict[str, Any], kind: str) -> float:
    return record["bytes_by_kind"].get(kind, 0) / record["tokens"]


def summarize(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (row, K), in run order: mean and sample std of the final val loss, ratios, bytes per token."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault((r["row"], r["K"]), []).append(r)
    summary = []
    for (name, k), runs in groups.items():
        losses = [r["val_loss"] for r in runs]
        summary.append(
            {
                "row": name,
                "K": k,
                "H": runs[0]["H"],
                "seeds": len(runs),
                "tokens": runs[0]["tokens"],
                "val_loss_mean": statistics.fmean(losses),
                "val_loss_std": statistics.stdev(losses) if len(losses) > 1 else None,
                "pg_bytes_per_token": statistics.fmean(per_token(r, "pseudo_gradients") for r in runs),
                "bytes_per_token": statistics.fmean(sum(r["bytes_by_kind"].values()) / r["tokens"] for r in runs),
            }
        )
    for s in summary:  # the references are rows of the same K, whichever were run
        ddp = next((d for d in summary if d["row"] == "ddp" and d["K"] == s["K"]), None)
        one = next((d for d in summary if d["row"] == "one-process" and d["K"] == s["K"]), None)
        ddp_grad = statistics.fmean(per_token(r, "gradients") for r in groups[("ddp", s["K"])]) if ddp else None
        s["vs_ddp"] = s["val_loss_mean"] / ddp["val_loss_mean"] if ddp else None
        s["vs_one_process"] = s["val_loss_mean"] / one["val_loss_mean"] if one else None
        s["ddp_grad_bytes_per_token"] = ddp_grad
        s["pg_reduction"] = ddp_grad / s["pg_bytes_per_token"] if ddp_grad and s["pg_bytes_per_token"] else None
    return summary


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(summary: list[dict[str, Any]]) -> None:
    header = (
        f"{'row':<22} {'K':>2} {'H':>4} {'n':>2} {'val mean':>8} {'std':>7} {'÷ddp':>6} {'÷1proc':>6} "
        f"{'pg B/tok':>9} {'ddp grad B/tok':>14} {'pg reduction':>12} {'total B/tok':>11}"
    )
    print("\n" + header + "\n" + "-" * len(header))
    for s in summary:
        print(
            f"{s['row']:<22} {s['K']:>2} {fmt(s['H'], 'd'):>4} {s['seeds']:>2} {s['val_loss_mean']:8.4f} "
            f"{fmt(s['val_loss_std'], '.4f'):>7} {fmt(s['vs_ddp'], '.3f'):>6} {fmt(s['vs_one_process'], '.3f'):>6} "
            f"{s['pg_bytes_per_token']:9.3f} {fmt(s['ddp_grad_bytes_per_token'], '.1f'):>14} "
            f"{fmt(s['pg_reduction'], '.1f'):>12} {s['bytes_per_token']:11.1f}",
            flush=True,
        )


def mean_curve(runs: list[dict[str, Any]]) -> tuple[list[float], list[float], list[float]]:
    """Tokens, cumulative bytes sent (all kinds) and val loss at each log point, averaged over seeds."""
    logs = [r["log"] for r in runs]
    n = min(len(log) for log in logs)  # seeds of one row log at the same points; guard anyway
    tokens = [logs[0][i]["tokens"] for i in range(n)]
    sent = [statistics.fmean(log[i]["bytes_per_token"] * log[i]["tokens"] for log in logs) for i in range(n)]
    loss = [statistics.fmean(log[i]["val_loss"] for log in logs) for i in range(n)]
    return tokens, sent, loss


def plot(records: list[dict[str, Any]], path: str) -> None:
    """Two panels: mean val loss against tokens, and against cumulative bytes sent (one process sends none)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault((r["row"], r["K"]), []).append(r)
    fig, (by_tokens, by_bytes) = plt.subplots(1, 2, figsize=(13, 5))
    for (name, k), runs in groups.items():
        tokens, sent, loss = mean_curve(runs)
        label = f"{name} K={k}"
        (line,) = by_tokens.plot(tokens, loss, marker=".", label=label)
        if sent[-1] > 0:  # a log axis has no room for zero bytes
            by_bytes.plot(sent, loss, marker=".", color=line.get_color(), label=label)
    by_tokens.set(xlabel="training tokens", ylabel="val loss (mean over seeds)", title="val loss against tokens")
    by_bytes.set(
        xlabel="bytes sent, all kinds (log)",
        ylabel="val loss (mean over seeds)",
        xscale="log",
        title="val loss against bytes sent",
    )
    by_tokens.legend(fontsize=7)
    by_bytes.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def write_json(path: str, args: argparse.Namespace, records: list[dict[str, Any]]) -> None:
    with open(path, "w") as f:
        json.dump({"args": vars(args), "records": records, "summary": summarize(records)}, f, indent=1)


@dataclass(frozen=True)
class Planned:
    """One run of the study: a row at K replicas with one seed."""

    row: Row
    replicas: int
    seed: int


_corpus: Corpus | None = None  # one per process: loaded by run_plan, or by each worker's initializer


def _start_worker(threads: int, corpus_paths: list[str] | None) -> None:
    global _corpus
    torch.set_num_threads(threads)
    _corpus = load_corpus(corpus_paths)


def _run_planned(index: int, run: Planned, base: SwarmConfig, args: argparse.Namespace) -> tuple[int, dict[str, Any]]:
    assert _corpus is not None, "the corpus is loaded before any run"
    cfg = row_config(base, run.row, codec=args.codec, h=args.h, seed=run.seed)
    return index, run_one(
        run.row, cfg, _corpus, replicas=run.replicas, steps=args.steps, seed=run.seed, log_points=args.log_points
    )


def run_plan(plan: list[Planned], base: SwarmConfig, args: argparse.Namespace) -> Iterator[tuple[int, dict[str, Any]]]:
    """(plan index, record) of every run, as each finishes: in order here, or ``--jobs`` at once in worker processes."""
    if args.jobs == 1:
        _start_worker(args.threads, args.corpus)
        for i, run in enumerate(plan):
            yield _run_planned(i, run, base, args)
        return
    # spawn, not fork: a forked child would inherit torch's thread pool state from the parent
    with concurrent.futures.ProcessPoolExecutor(
        max_workers=min(args.jobs, len(plan)),
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_start_worker,
        initargs=(args.threads, args.corpus),
    ) as pool:
        futures = [pool.submit(_run_planned, i, run, base, args) for i, run in enumerate(plan)]
        for future in concurrent.futures.as_completed(futures):
            yield future.result()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--preset",
        choices=sorted(STUDY_PRESETS),
        default="default",
        help="small: a 64-wide, 4-layer, 2-stage model; micro (32, 2 layers) and medium (128, 8) beside it for the size curve",
    )
    parser.add_argument(
        "--replicas", type=int, nargs="+", default=[2, 4], help="K replicas per stage; every row runs at each"
    )
    parser.add_argument(
        "--steps", type=int, default=500, help="inner steps per replica (tokens = steps·K·inner_batch·seq_len)"
    )
    parser.add_argument("--seeds", type=int, default=3, help="seeds per row and K (0..N-1)")
    parser.add_argument(
        "--first-seed", type=int, default=0, help="start the seeds here (seeds run in parallel, merged with --replot)"
    )
    parser.add_argument(
        "--set",
        nargs="+",
        default=[],
        metavar="PATH=VALUE",
        help="config overrides for every row, baselines included (e.g. train.inner_batch=64: a larger batch per replica)",
    )
    parser.add_argument(
        "--h", type=int, default=20, help="H for outer rows that do not set their own (0: the config's)"
    )
    add_field_arguments(parser, SwarmConfig, "codecs.activations", flags={"codecs.activations": ("--codec",)})
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these rows (exact names)")
    parser.add_argument("--log-points", type=int, default=10, help="val-loss evaluations per run, for the curves")
    parser.add_argument(
        "--corpus", nargs="+", metavar="PATH", help="text files or folders (default: the stdlib sources)"
    )
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (per run)")
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="runs at once, each in its own process with --threads threads (a run is deterministic per seed: the"
        " results do not depend on it)",
    )
    parser.add_argument(
        "--replot",
        nargs="+",
        metavar="JSON",
        help="train nothing: merge the records of earlier --json files (e.g. rows run in parallel), print their table,"
        " and write --json / draw --plot from them",
    )
    parser.add_argument("--json", help="write args, per-run records and the summary here (rewritten after every run)")
    parser.add_argument(
        "--plot", metavar="PATH.png", help="plot val loss against tokens and bytes sent (needs matplotlib)"
    )
    args = parser.parse_args()
    if args.plot and importlib.util.find_spec("matplotlib") is None:  # say so now, not after hours of training
        parser.error("--plot needs matplotlib, which is not installed: `pip install matplotlib`, or leave --plot out")
    if (
        min(args.replicas) < 1
        or args.steps < 1
        or args.seeds < 1
        or args.log_points < 1
        or args.h < 0
        or args.first_seed < 0
        or args.jobs < 1
        or args.threads < 1
    ):
        parser.error(
            "--replicas, --steps, --seeds, --log-points, --jobs and --threads must be positive,"
            " --h and --first-seed non-negative"
        )
    return args


def main() -> None:
    args = parse_args()
    if args.replot:  # a finished study (or rows of it run in parallel) again, without training
        records = []
        for path in args.replot:
            with open(path) as f:
                records += json.load(f)["records"]
        print_table(summarize(records))
        if args.json:
            write_json(args.json, args, records)
        if args.plot:
            plot(records, args.plot)
        return
    try:
        base = derive_config(SwarmConfig(), STUDY_PRESETS[args.preset] | parse_overrides(args.set))
    except ValueError as e:  # a malformed pair, an unknown field, a value the config refuses
        raise SystemExit(f"--set: {e}") from None
    rows = [r for r in ROWS if not args.only or r.name in args.only]
    if not rows:
        raise SystemExit(f"no row matches --only {' '.join(args.only)}; rows: {', '.join(r.name for r in ROWS)}")
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    plan = [Planned(row, k, seed) for k in args.replicas for row in rows for seed in seeds]
    done: dict[int, dict[str, Any]] = {}  # plan index → record; the JSON keeps plan order whatever finishes first
    for n, (i, rec) in enumerate(run_plan(plan, base, args), 1):
        done[i] = rec
        print(
            f"[{n}/{len(plan)}] {rec['row']:<22} K={rec['K']} seed={rec['seed']} val {rec['val_loss']:.4f} "
            f"pg {per_token(rec, 'pseudo_gradients'):.3f} B/tok  {rec['tokens']} tokens  {rec['wall_s']:.0f}s",
            flush=True,
        )
        if args.json:  # a long study interrupted keeps what it measured
            write_json(args.json, args, [done[j] for j in sorted(done)])
    records = [done[j] for j in sorted(done)]
    print_table(summarize(records))
    if args.json:
        print(f"wrote {args.json}")
    if args.plot:
        plot(records, args.plot)


if __name__ == "__main__":
    main()
