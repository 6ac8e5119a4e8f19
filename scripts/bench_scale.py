"""Model presets in a real swarm: tokens/s, peak memory per peer, outer-round time and state-download time, by preset.

Each preset runs ``swarmloco local`` on loopback: 1 trainer and 3 stage servers over 2 middle stages
(stage 1 has two replicas, so its outer rounds have two members), plus one peer that joins mid-run with
``--role auto`` and downloads its stage's state. Every peer is its own process; its peak RSS is its
own high-water mark (``peak_rss_mb`` in its metrics records), set beside the estimate a peer prints
before it allocates (``swarm/model/sizing.py``).

    python scripts/bench_scale.py --json docs/data/scale.json                       # tiny, 20m, 125m on CPU
    python scripts/bench_scale.py --presets tiny --steps 20                          # a quick look
    python scripts/bench_scale.py --presets 125m --device cuda --precision bf16     # on a GPU machine
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from peer.launch import LocalSwarm, launch_local  # noqa: E402
from swarm.config import SwarmConfig, derive_config  # noqa: E402
from swarm.model.sizing import StageFootprint, model_parameters  # noqa: E402

HEADER = (
    f"{'preset':<7} {'params':>8} {'tok/s':>7} {'step s':>7} {'RSS MB trainer / stage1 / stage2 / joiner':>44} "
    f"{'est. MB st1':>11} {'round s':>8} {'members':>7} {'download s':>10} {'state MB':>8}"
)


def read_peers(out: Path) -> dict[str, list[dict[str, Any]]]:
    return {path.stem: [json.loads(line) for line in path.read_text().splitlines()] for path in out.glob("*.jsonl")}


def summarize(cfg: SwarmConfig, peers: dict[str, list[dict[str, Any]]], wall_s: float) -> dict[str, Any]:
    trainer = next(r for r in reversed(peers["trainer-0"]) if r.get("role") == "trainer")
    rounds = [r for rs in peers.values() for r in rs if r.get("event") == "outer_round" and r["outcome"] == "done"]
    shared = [r for r in rounds if r["contributors"] > 1]
    downloads = [r for rs in peers.values() for r in rs if r.get("event") == "state_download" and "download_s" in r]
    peak = {name: max((r.get("peak_rss_mb", 0.0) for r in records), default=0.0) for name, records in peers.items()}
    download = downloads[0] if downloads else None
    return {
        "parameters": model_parameters(cfg.model),
        "tokens": trainer["tokens"],
        "tokens_per_s": trainer["tokens_per_s"],
        "step_s": cfg.train.inner_batch * cfg.train.seq_len / trainer["tokens_per_s"],
        "val_loss": trainer.get("val_loss"),
        "peak_rss_mb": peak,
        "estimate_mb": {
            str(stage): StageFootprint.of(cfg, stage).total_bytes / 2**20 for stage in range(cfg.stages.num_stages + 1)
        },
        "outer_rounds_done": len(rounds),
        "round_s": statistics.median(r["round_s"] for r in (shared or rounds)) if rounds else None,
        "round_members": max((r["contributors"] for r in rounds), default=0),
        "download_s": download and download["download_s"],
        "download_stage": download and download["stage"],
        "state_mb": download
        and 4 * StageFootprint.of(cfg, download["stage"]).parameters / 2**20 * (2 if cfg.outer.method != "none" else 1),
        "wall_s": wall_s,
    }


def run_preset(preset: str, args: argparse.Namespace) -> dict[str, Any]:
    cfg = derive_config(
        SwarmConfig(),
        {
            "model.preset": preset,
            "stages.num_stages": 2,
            "train.seq_len": args.seq_len,
            "train.microbatch_size": args.microbatch,
            "train.inner_batch": args.microbatch,
            "train.precision": args.precision,
            "outer.inner_steps": args.h,
            "inner.total_steps": args.steps,
        },
    )
    layout = LocalSwarm(peers=4, stages=2, trainers=1, steps=args.steps, joiners=1, join_after_s=args.join_after)
    print(f"{preset}: {model_parameters(cfg.model) / 1e6:.1f}M parameters; {StageFootprint.of(cfg, 1).describe()}")
    with tempfile.TemporaryDirectory(prefix=f"bench-scale-{preset}-") as tmp:
        started = time.perf_counter()
        code = launch_local(
            layout, out=Path(tmp), config=cfg, extra_args=["--device", args.device], export=False, echo=lambda s: None
        )
        if code != 0:
            raise SystemExit(f"{preset}: the swarm failed (exit {code})")
        return {"preset": preset, **summarize(cfg, read_peers(Path(tmp)), time.perf_counter() - started)}


def row(r: dict[str, Any]) -> str:
    rss = " / ".join(
        f"{r['peak_rss_mb'].get(name, 0):.0f}"
        for name in ("trainer-0", "stage1-0", "stage2-0", next((n for n in r["peak_rss_mb"] if "join" in n), ""))
    )
    fmt = lambda v, spec: format(v, spec) if v is not None else "–"
    return (
        f"{r['preset']:<7} {r['parameters'] / 1e6:>7.1f}M {r['tokens_per_s']:>7.0f} {r['step_s']:>7.2f} {rss:>44} "
        f"{r['estimate_mb']['1']:>11.0f} {fmt(r['round_s'], '8.2f')} {r['round_members']:>7} "
        f"{fmt(r['download_s'], '10.2f')} {fmt(r['state_mb'], '8.0f')}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["tiny", "20m", "125m"])
    parser.add_argument("--steps", type=int, default=20, help="inner steps of the trainer")
    parser.add_argument("--h", type=int, default=10, help="inner steps between outer rounds")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--microbatch", type=int, default=4, help="samples per microbatch (= per inner step)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--join-after", type=float, default=10.0, help="seconds into training the joiner starts")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    results = []
    for preset in args.presets:
        results.append(run_preset(preset, args))
        print(HEADER)
        for r in results:
            print(row(r))
    load = os.getloadavg()
    print(f"load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1 / 5 / 15 min); {os.cpu_count()} CPUs")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "load": load, "results": results}, indent=1)
        )
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
