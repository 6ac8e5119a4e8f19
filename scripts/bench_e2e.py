"""End to end: the swarm in the WAN lab, each peer behind its own capped link, across codecs, outer methods and skips.

Every run is a whole swarm (``launch_local``) with one peer per network namespace of a
``WanLab`` (``swarmtest/wanlab.py``), all capped at the run's bandwidth in each direction (or
uncapped) and, with ``--rtt-ms``, behind the same round-trip delay (the lab's delay line; one
value for every peer, or one per peer: the stage servers, then the trainers), training the
default model on the default corpus for the same number of steps. Each stage server's busy
fraction (its request compute over wall time, the median of its recent values while it served)
is a column of the table: how much of the time the pipeline keeps that stage working.
The layout is two trainers and three middle stages with one server each: the trainers are the
replicas of stage 0, so outer rounds really exchange pseudo-gradients, and a skip ratio of 0.33
drops exactly one of the three stages per microbatch.

The plan varies one thing at a time around SparseLoCo with int8 activations: every activation
codec (``none`` is fp32 on the wire; ``adaptive`` chooses per link by measured throughput) at
every bandwidth, DiLoCo (fp32 exchange) instead of SparseLoCo, and skip 0.33. ``--repeats`` runs the plan several times, interleaved, and reports
medians: the machine is shared and time-sliced, so every tokens/s is relative to the uncapped
run of the same configuration measured in the same invocation.

    sudo python scripts/bench_e2e.py --json bench-e2e.json --plot docs/bench-e2e.png    # ~60 min per repeat on 2 cores
    sudo python scripts/bench_e2e.py --steps 40 --only int8                             # a quick look
    sudo python scripts/bench_e2e.py --steps 40 --only int8 --bandwidths 20,none --rtt-ms 100  # with 100 ms round trips
    sudo python scripts/bench_e2e.py --only int8 adaptive --bandwidths 20,none --repeats 2    # link-adaptive vs int8
    sudo python scripts/bench_e2e.py --windows 1,4 --bandwidths 20,none --rtt-ms 100 --repeats 2  # window vs synchronous
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from peer.launch import LocalSwarm, Placement, local_config
from swarm.cli_fields import add_field_arguments
from swarm.config import OuterChoice, SwarmConfig, TrainerOptions, derive_config
from swarm.node.config import PeerConfig
from swarmtest.bench import run_swarm, window_options
from swarmtest.wanlab import WanLab, parse_rtts, unsupported_reason

LAYOUT = dict(trainers=2, stages=3)  # and one server per stage
# "adaptive": each trainer picks per link from bf16/int8/int4 by the link's measured throughput (compress/adaptive.py)
ACT_CODECS = ("none", "int8", "subspace", "adaptive")
TARGET_KEEP = 0.8  # at 20 Mbit/s, compressed, at least 80% of the uncapped tokens/s
TARGET_SKIP_STEP_CUT, TARGET_SKIP_LOSS = 0.25, 0.03  # skip 0.33: ≥ 25% less time per step at ≤ 3% loss


@dataclasses.dataclass(frozen=True, kw_only=True)
class Run:
    bandwidth_mbit: float | None  # per peer, each direction; None: uncapped
    act_codec: str = "int8"  # activations and their gradients; "none": fp32; "adaptive": per link
    outer: OuterChoice = "sparseloco"
    skip: float = 0.0
    window: int | None = None  # the trainers' window cap (--in-flight); 1: the synchronous pipeline; None: the default
    max_staleness: int | None = None  # inner steps the window may span (None: the trainers' default, 0)

    @property
    def name(self) -> str:
        bw = "unlimited" if self.bandwidth_mbit is None else f"{self.bandwidth_mbit:g}Mbit"
        name = f"{bw}/{self.act_codec}/{self.outer}/skip{self.skip:g}" + (f"/w{self.window}" if self.window else "")
        return name + ("" if self.max_staleness is None else f"/s{self.max_staleness}")

    def trainer_options(self) -> TrainerOptions:
        return window_options(self.window, self.max_staleness)


def plan(
    bandwidths: list[float | None], windows: list[int] | None = None, max_staleness: int | None = None
) -> list[Run]:
    if windows:  # the window study: int8 SparseLoCo at every bandwidth, once per window cap
        return [Run(bandwidth_mbit=bw, window=w, max_staleness=max_staleness) for bw in bandwidths for w in windows]
    runs = [Run(bandwidth_mbit=bw, act_codec=codec) for bw in bandwidths for codec in ACT_CODECS]
    low = [bw for bw in bandwidths if bw is not None][:1]  # the lowest cap, and uncapped
    for bw in [*low, None]:
        runs += [Run(bandwidth_mbit=bw, outer="diloco"), Run(bandwidth_mbit=bw, skip=0.33)]
    return runs


def run_config(base: SwarmConfig, run: Run, layout: LocalSwarm, inner_steps: int) -> SwarmConfig:
    codec = "fp32" if run.act_codec == "none" else run.act_codec
    overrides = {
        "codecs.activations": codec,
        "codecs.pseudo_gradients": "fp32",
        "outer.inner_steps": inner_steps,
        "paths.skip_ratio": run.skip,
    }
    return derive_config(local_config(base, layout), overrides, outer=run.outer)


def peer_names(layout: LocalSwarm) -> list[str]:
    """The peers in lab host order: stage servers, then trainers."""
    return [name for name, _ in layout.servers()] + [f"trainer-{i}" for i in range(layout.trainers)]


def measure(
    run: Run,
    layout: LocalSwarm,
    base: SwarmConfig,
    inner_steps: int,
    data: list[str] | None,
    out: Path,
    rtts_ms: list[float] | None = None,
) -> dict[str, Any]:
    cfg = run_config(base, run, layout, inner_steps)
    names = peer_names(layout)
    with WanLab(caps_mbit=[run.bandwidth_mbit] * len(names), rtts_ms=rtts_ms) as lab:
        hosts = {
            name: Placement(prefix=tuple(lab.command(i, [])), host=lab.hosts[i].address) for i, name in enumerate(names)
        }
        swarm = run_swarm(cfg, layout, data, out, place=hosts.__getitem__, trainer=run.trainer_options())
    tokens_per_step = layout.trainers * cfg.train.inner_batch * cfg.train.seq_len  # one inner step of every trainer
    pseudo = swarm["pseudo_grad_bytes_per_token"]
    return {
        "name": run.name,
        **dataclasses.asdict(run),
        "tokens_per_s": swarm["tokens_per_s"],
        "val_loss": swarm["val_loss"],
        "tokens": swarm["tokens"],
        "step_s": tokens_per_step / swarm["tokens_per_s"],
        "bytes_per_token": {
            **swarm["bytes_per_token"],
            "pseudo_gradients": pseudo,
            "total": swarm["bytes_per_token"]["total"] + pseudo,
        },
        "fp32_bytes_per_token": swarm["fp32_bytes_per_token"],
        "outer_rounds": swarm["outer_rounds"],
        "failed_hops": swarm["failed_hops"],
        "skipped_hops": swarm["skipped_hops"],
        "wall_s": swarm["wall_s"],
        "rtt_ms": rtts_ms or [0.0] * len(names),
        "busy_fraction": swarm["busy_fraction"],  # per stage server
        "staleness_mean": swarm.get("staleness_mean"),
        "window_mean": swarm.get("window_mean"),
    }


def median_record(records: list[dict[str, Any]]) -> dict[str, Any]:
    out = dict(records[0])
    for key in ("tokens_per_s", "val_loss", "step_s", "wall_s"):
        out[key] = statistics.median(r[key] for r in records)
        out[f"{key}_runs"] = [r[key] for r in records]
    out["busy_fraction"] = {
        name: median_of_known([r["busy_fraction"].get(name) for r in records]) for name in out["busy_fraction"]
    }
    return out


def median_of_known(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def find(records: list[dict[str, Any]], **match: Any) -> dict[str, Any] | None:
    return next((r for r in records if all(r[k] == v for k, v in match.items())), None)


def check_targets(records: list[dict[str, Any]], low: float | None) -> dict[str, Any]:
    """The issue's targets, each with the numbers it was judged on (None where the plan lacks a run)."""
    targets: dict[str, Any] = {}
    windows = sorted({r["window"] for r in records if r["window"] is not None})
    for codec in ACT_CODECS if low is not None else ():
        for window in windows or [None]:
            capped, free = (
                find(records, bandwidth_mbit=low, act_codec=codec, outer="sparseloco", skip=0.0, window=window),
                find(records, bandwidth_mbit=None, act_codec=codec, outer="sparseloco", skip=0.0, window=window),
            )
            if capped and free:
                suffix = f"/w{window}" if window else ""
                targets[f"keep_at_{low:g}mbit/{codec}{suffix}"] = capped["tokens_per_s"] / free["tokens_per_s"]
    for bw in (low, None) if len(windows) > 1 else ():
        sync, widest = (find(records, bandwidth_mbit=bw, window=w) for w in (windows[0], windows[-1]))
        if sync and widest:
            label = "unlimited" if bw is None else f"{bw:g}mbit"
            targets[f"window_speedup/{label}/w{windows[-1]}_vs_w{windows[0]}"] = (
                widest["tokens_per_s"] / sync["tokens_per_s"]
            )
    for bw in (low, None):
        plain, skip = (
            find(records, bandwidth_mbit=bw, act_codec="int8", outer="sparseloco", skip=0.0),
            find(records, bandwidth_mbit=bw, act_codec="int8", outer="sparseloco", skip=0.33),
        )
        if plain and skip:
            label = "unlimited" if bw is None else f"{bw:g}mbit"
            targets[f"skip_step_cut/{label}"] = 1 - skip["step_s"] / plain["step_s"]
            targets[f"skip_loss_cost/{label}"] = skip["val_loss"] / plain["val_loss"] - 1
    met = {
        k: (
            None
            if k.endswith("/none")
            # uncompressed: shown for contrast, no target
            else v >= TARGET_KEEP
            if k.startswith("keep_at")
            else v >= TARGET_SKIP_STEP_CUT
            if k.startswith("skip_step_cut")
            else None
            if k.startswith("window_speedup")  # reported against the synchronous pipeline, no target
            else v <= TARGET_SKIP_LOSS
        )
        for k, v in targets.items()
    }
    return {"values": targets, "met": met}


def busy_label(server: str) -> str:
    """A busy-fraction column's header: ``stage2-0`` → ``busy s2-0``."""
    return "busy " + server.replace("stage", "s")


def fmt(value: float | None, spec: str) -> str:
    return format(value, spec) if value is not None else format("-", f">{spec.split('.')[0]}")


def print_table(records: list[dict[str, Any]]) -> None:
    servers = list(records[0]["busy_fraction"]) if records else []
    busy_header = "".join(f" {busy_label(name):>9}" for name in servers)
    header = f"{'run':<34} {'tok/s':>7} {'vs uncapped':>11} {'step s':>7} {'val_loss':>8} {'B/token':>9} {'act':>8} {'grad':>8} {'pseudo':>7} {'win':>4} {'stale':>5}{busy_header}"
    print("\n" + header + "\n" + "-" * len(header))
    for r in records:
        free = find(
            records, bandwidth_mbit=None, act_codec=r["act_codec"], outer=r["outer"], skip=r["skip"], window=r["window"]
        )
        rel = f"{r['tokens_per_s'] / free['tokens_per_s']:.2f}" if free else "-"
        b = r["bytes_per_token"]
        print(
            f"{r['name']:<34} {r['tokens_per_s']:7.0f} {rel:>11} {r['step_s']:7.2f} {r['val_loss']:8.4f} {b['total']:9.1f} "
            f"{b['activations']:8.1f} {b['gradients']:8.1f} {b['pseudo_gradients']:7.2f}"
            f" {fmt(r.get('window_mean'), '4.1f')} {fmt(r.get('staleness_mean'), '5.2f')}"
            + "".join(
                f" {busy:9.2f}" if (busy := r["busy_fraction"].get(name)) is not None else f" {'-':>9}"
                for name in servers
            )
        )


def plot(records: list[dict[str, Any]], path: Path) -> None:
    """Tokens/s against bandwidth, one line per configuration; uncapped drawn at the right edge."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    caps = sorted({r["bandwidth_mbit"] for r in records if r["bandwidth_mbit"] is not None})
    free_x = caps[-1] * 4 if caps else 1.0
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for config in sorted({(r["act_codec"], r["outer"], r["skip"]) for r in records}):
        rows = sorted(
            (r["bandwidth_mbit"] or free_x, r["tokens_per_s"])
            for r in records
            if (r["act_codec"], r["outer"], r["skip"]) == config
        )
        ax.plot(*zip(*rows), marker="o", label=f"{config[0]} / {config[1]} / skip {config[2]:g}")
    ax.set_xscale("log")
    ax.set_xticks([*caps, free_x], [*(f"{c:g}" for c in caps), "uncapped"])
    ax.minorticks_off()
    ax.set_xlabel("bandwidth per peer, each direction (Mbit/s)")
    ax.set_ylabel("training tokens/s (both trainers)")
    ax.set_title("swarmloco in the WAN lab: 2 trainers, 3 stages, 2 CPU cores")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_bandwidths(text: str) -> list[float | None]:
    return [None if part in ("none", "unlimited") else float(part) for part in text.split(",")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_field_arguments(parser, LocalSwarm, "steps", defaults={"steps": 50})  # in every run
    parser.add_argument(
        "--microbatch",
        type=int,
        help="samples per microbatch (default: the config's, 4 of an inner batch of 16; 16 is one per inner step, the "
        "synchronous pipeline at --windows 1); the trainer's window keeps several in flight within a step",
    )
    parser.add_argument(
        "-H",
        "--inner-steps",
        type=int,
        default=10,
        help="H: inner steps between outer steps; short runs need several rounds for SparseLoCo's error feedback to pay back",
    )
    parser.add_argument(
        "--bandwidths",
        type=parse_bandwidths,
        default=[20.0, 100.0, None],
        help="Mbit/s per peer, comma separated; 'none' is uncapped",
    )
    parser.add_argument(
        "--rtt-ms",
        default="0",
        help="round-trip delay of every peer's link in ms, or one per peer (stage servers, then trainers), "
        "comma separated; the round trip between two peers is the mean of theirs (see scripts/wanlab.py)",
    )
    parser.add_argument(
        "--windows",
        type=lambda text: [int(w) for w in text.split(",")],
        help="the window study: int8 SparseLoCo at every bandwidth once per trainer window cap, e.g. 1,4 "
        "(1 is the synchronous pipeline)",
    )
    # None: the trainers' own (0: within an inner step, which at a microbatch below the inner batch still overlaps
    # the step's microbatches; 6 lets a window of 4 span steps)
    add_field_arguments(parser, TrainerOptions, "max_staleness", defaults={"max_staleness": None})
    parser.add_argument("--repeats", type=int, default=1, help="runs of the whole plan (interleaved); medians reported")
    parser.add_argument("--only", nargs="*", help="run only plan entries whose name contains one of these")
    add_field_arguments(parser, PeerConfig, "data")
    parser.add_argument("--out", type=Path, help="keep every run's logs and metrics under this directory")
    parser.add_argument("--json", type=Path, help="write the records here")
    parser.add_argument("--plot", type=Path, help="write a PNG of tokens/s against bandwidth here")
    args = parser.parse_args()
    if (reason := unsupported_reason()) is not None:
        print(f"error: the WAN lab cannot run here: {reason}", file=sys.stderr)
        return 2

    base = SwarmConfig()
    if args.microbatch:
        base = dataclasses.replace(base, train=dataclasses.replace(base.train, microbatch_size=args.microbatch))
    layout = LocalSwarm(peers=LAYOUT["trainers"] + LAYOUT["stages"], steps=args.steps, **LAYOUT)
    try:
        rtts_ms = parse_rtts(args.rtt_ms, len(peer_names(layout)))
    except ValueError as e:
        parser.error(str(e))
    runs = [
        run
        for run in plan(args.bandwidths, args.windows, args.max_staleness)
        if not args.only or any(s in run.name for s in args.only)
    ]
    results: dict[str, list[dict[str, Any]]] = {run.name: [] for run in runs}
    with tempfile.TemporaryDirectory(prefix="bench-e2e-") as tmp:
        root = args.out or Path(tmp)
        for repeat in range(args.repeats):
            for k, run in enumerate(runs):
                print(f"[{repeat + 1}/{args.repeats}] run {k + 1}/{len(runs)}: {run.name}", flush=True)
                started = time.perf_counter()
                record = measure(
                    run,
                    layout,
                    base,
                    args.inner_steps,
                    args.data,
                    root / f"{repeat}" / run.name.replace("/", "_"),
                    rtts_ms,
                )
                results[run.name].append(record)
                print(
                    f"    {record['tokens_per_s']:.0f} tok/s  step {record['step_s']:.2f}s  val {record['val_loss']:.4f}  "
                    f"{record['bytes_per_token']['total']:.0f} B/token  ({time.perf_counter() - started:.0f}s)",
                    flush=True,
                )
    records = [median_record(rs) for rs in results.values()]
    print_table(records)
    low = min((bw for bw in args.bandwidths if bw is not None), default=None)
    targets = check_targets(records, low)
    for key, value in targets["values"].items():
        print(f"  {key:<32} {value:+.3f}  met: {targets['met'][key]}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "steps": args.steps,
                    "inner_steps": args.inner_steps,
                    "train": dataclasses.asdict(base.train),
                    "repeats": args.repeats,
                    "layout": LAYOUT,
                    "rtt_ms": rtts_ms,
                    "records": records,
                    "targets": targets,
                },
                indent=1,
            )
        )
        print(f"wrote {args.json}")
    if args.plot:
        plot(records, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
