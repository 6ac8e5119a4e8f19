"""Full-model peers beside pipelines, in the simulator: validation loss and wire bytes per token by kind of replica.

Two replicas of every stage, SparseLoCo over all of them, at equal tokens: (a) both pipelined (their microbatches
hop between stage replicas through the activation codec), (b) one full peer (its own copy of every stage, no wire)
and one pipelined, (c) both full. Each with int8 and with subspace boundaries. The selective-compression row (b*)
is (b) with the full replica's boundaries compressed as well, as if every replica were compressed: the paper
"Heterogeneous Low-Bandwidth Pre-Training of LLMs" finds compressing only the pipelined replicas the better trade.
Bytes are the pipelined replicas' activation traffic and everyone's pseudo-gradients; a full replica sends no
activations.

With ``--real`` the rows run as real local swarms instead (``swarmloco local``, processes on loopback, one
seed, the codecs in ``--codecs``): (a) 2 trainers and 2 servers of every middle stage, (b) 1 trainer, 1 server per
stage and 1 full peer (b*: its boundaries coded with ``codecs.full_boundaries = "compressed"``), (c) 2 full peers and
no pipeline; the small model (docs/data/small-model.toml) with
``--stages`` middle stages. Every replica trains ``--steps`` inner steps, so each row trains on the same tokens.
Besides each replica's validation loss and the bytes per token by kind, the peers' round records say how many of
every stage's outer rounds had both replicas' pseudo-gradients (and the full peer's), and whether the replicas logged
the same global weights hash after each round and at the end.

    python scripts/bench_full_peers.py --seeds 3 --json docs/data/full-peers.json     # small model, ~10 min on 2 cores
    python scripts/bench_full_peers.py --real --codecs int8 --json docs/data/full-peers-real.json   # ~3 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from peer.data import load_corpus
from peer.launch import READY_PREFIX, LocalSwarm, local_config
from swarm.cli_fields import add_field_arguments
from swarm.config import SwarmConfig, derive_config
from swarm.config_toml import load_config
from swarm.events import Event, OuterRound, Serving, StateDownload
from swarm.node.config import PeerConfig
from swarm.sim.simulate import SimulationConfig, simulate
from swarmtest.bench import bench_config, read_peers, run_swarm
from swarmtest.configs import STUDY_PRESETS

SMALL_MODEL = Path(__file__).resolve().parents[1] / "docs" / "data" / "small-model.toml"
REPLICAS = 2  # of every stage, in every row

ROWS: dict[str, dict[str, Any]] = {  # name: full replicas of 2, codecs.full_boundaries (the full ones' own boundaries)
    "a: 2 pipelined": {"full": 0, "full_boundaries": "none"},
    "b: 1 full + 1 pipelined": {"full": 1, "full_boundaries": "none"},
    "b*: as b, full compressed too": {"full": 1, "full_boundaries": "compressed"},
    "c: 2 full": {"full": 2, "full_boundaries": "none"},
}


def run(codec: str, row: dict[str, Any], *, seed: int, args: argparse.Namespace, corpus: Any) -> dict[str, Any]:
    overrides = {
        **STUDY_PRESETS["small"],
        "codecs.activations": codec,
        "codecs.full_boundaries": row["full_boundaries"],
        "outer.inner_steps": args.h,
        "train.seed": seed,
    }
    cfg = derive_config(SwarmConfig(), overrides, outer="sparseloco")
    t = cfg.train
    streams = [
        corpus.sample_batches("train", batch_size=t.microbatch_size, seq_len=t.seq_len, seed=seed + 1000 * k)
        for k in range(2)
    ]
    val = corpus.val_batches(batch_size=t.microbatch_size, seq_len=t.seq_len, num_sequences=8 * t.microbatch_size)
    sim = SimulationConfig(replicas=2, tokens=args.tokens, seed=seed, log_every=10**9, full=row["full"])
    result = simulate(cfg, sim, streams, val)
    per = result.bytes_per_token
    return {
        "val_loss": result.val_loss,
        "activation_bytes_per_token": per["activations"] + per["activation_gradients"],
        "pseudo_grad_bytes_per_token": per["pseudo_gradients"],
    }


def real_layout(row: dict[str, Any], *, stages: int, steps: int) -> LocalSwarm:
    """The local swarm of a row: its full peers, and a trainer with a server of every middle stage per pipelined
    replica (a row of full peers only has no pipeline)."""
    pipelined = REPLICAS - row["full"]
    return LocalSwarm(peers=pipelined * (1 + stages), stages=stages, trainers=pipelined, steps=steps, full=row["full"])


def peer_ids(out: Path, names: list[str]) -> dict[str, str]:
    """Each peer's id (the ``/p2p/`` part of the address it printed when ready), by name."""
    ids = {}
    for name in names:
        log = out / f"{name}.log"
        ready = [line for line in log.read_text().splitlines() if line.startswith(READY_PREFIX)] if log.exists() else []
        if ready and (found := re.search(r"/p2p/(\w+)", ready[0])):
            ids[found.group(1)] = name
    return ids


def round_evidence(peers: dict[str, list[Event]], names: dict[str, str]) -> dict[str, Any]:
    """Per stage, from every replica's round records: the outer rounds done, how many had two contributors and how
    many the full peer's pseudo-gradient, how many rounds' members logged different global weights hashes, the last
    round every replica of the stage logged; and each replica's last global hash (``names``: peer id -> name, to tell
    the full peers among the contributors)."""
    rounds: dict[int, dict[int, dict[str, Any]]] = defaultdict(dict)
    done_by: dict[int, dict[str, set[int]]] = defaultdict(lambda: defaultdict(set))  # stage -> replica -> its rounds
    last_hash: dict[int, dict[str, str]] = defaultdict(dict)  # stage -> replica -> its last global hash
    for name, records in peers.items():
        for r in records:
            if isinstance(r, (OuterRound, StateDownload, Serving)) and r.global_hash:
                last_hash[r.stage][name] = r.global_hash
            if isinstance(r, OuterRound) and r.outcome == "done":
                # a round two replicas each did alone (split) shows as two hashes, not as two contributors
                seen = rounds[r.stage].setdefault(r.round, {"contributors": 0, "full": False, "hashes": set()})
                seen["contributors"] = max(seen["contributors"], len(r.contributor_ids))
                seen["full"] |= any(names.get(peer, "").startswith("full-") for peer in r.contributor_ids)
                seen["hashes"].add(r.global_hash)
                done_by[r.stage][name].add(r.round)
    stages = {}
    for stage in sorted(rounds):
        done = rounds[stage].values()
        common = set.intersection(*done_by[stage].values())
        stages[str(stage)] = {
            "rounds_done": len(done),
            "rounds_with_2_contributors": sum(seen["contributors"] >= REPLICAS for seen in done),
            "rounds_with_a_full_peer": sum(seen["full"] for seen in done),
            "rounds_with_differing_hashes": sum(len(seen["hashes"]) > 1 for seen in done),
            "last_round_all_replicas_did": max(common, default=None),
            "final_hashes": last_hash[stage],
            "final_hashes_agree": len(set(last_hash[stage].values())) == 1,
        }
    return {
        "stages": stages,
        "hashes_agree_after_every_round": all(s["rounds_with_differing_hashes"] == 0 for s in stages.values()),
        "final_hashes_agree": all(s["final_hashes_agree"] for s in stages.values()),
    }


def real_config(layout: LocalSwarm, row: dict[str, Any], codec: str, args: argparse.Namespace) -> SwarmConfig:
    """The row's swarm config: ``--config`` with the layout's stages and shards, SparseLoCo every ``--h`` steps, the
    row's ``codecs.full_boundaries``."""
    cfg = bench_config(local_config(load_config(args.config), layout), "sparseloco", args.h, codec)
    return derive_config(cfg, {"codecs.full_boundaries": row["full_boundaries"]})


def run_real(name: str, row: dict[str, Any], codec: str, args: argparse.Namespace) -> dict[str, Any]:
    """One row as a real local swarm: its replicas' validation losses, bytes per token by kind, and round evidence."""
    layout = real_layout(row, stages=args.stages, steps=args.steps)
    cfg = real_config(layout, row, codec, args)
    with tempfile.TemporaryDirectory(prefix="bench-full-peers-") as tmp:
        out = args.out / f"{codec}-{name.split(':')[0]}" if args.out else Path(tmp)
        swarm = run_swarm(cfg, layout, args.data, out)
        peers = read_peers(out)
        evidence = round_evidence(peers, peer_ids(out, list(peers)))
    losses = [loss for loss in swarm["val_losses"].values() if loss is not None]
    return {
        "codec": codec,
        "row": name,
        "trainers": layout.trainers,
        "servers_per_stage": (layout.peers - layout.trainers) // layout.stages,
        "full": layout.full,
        "stages": layout.stages,
        "steps": layout.steps,
        "inner_steps": cfg.outer.inner_steps,
        "config_hash": cfg.hash(),
        "val_losses": swarm["val_losses"],
        "val_loss_mean": statistics.mean(losses),
        "tokens": swarm["tokens"],
        "activation_bytes_per_token": swarm["bytes_per_token"]["activations"],
        "gradient_bytes_per_token": swarm["bytes_per_token"]["gradients"],
        "pseudo_grad_bytes_per_token": swarm["pseudo_grad_bytes_per_token"],
        "outer_rounds": evidence["stages"],
        "hashes_agree_after_every_round": evidence["hashes_agree_after_every_round"],
        "final_hashes_agree": evidence["final_hashes_agree"],
        "failed_hops": swarm["failed_hops"],
        "outer_failed_or_late": swarm["outer_failed_or_late"],
        "state_downloads": swarm["state_downloads"],
        "wall_s": swarm["wall_s"],
    }


def yes(flag: bool) -> str:
    return "yes" if flag else "NO"


def print_real(r: dict[str, Any]) -> None:
    """One row: each replica's loss and their mean, tokens, bytes per token, rounds per stage (done / with both
    replicas / with a full peer), and whether the hashes agreed after each round and at the end."""
    losses = " / ".join(f"{loss:.4f}" for loss in r["val_losses"].values())
    rounds = " ".join(
        f"s{stage}:{s['rounds_done']}/{s['rounds_with_2_contributors']}/{s['rounds_with_a_full_peer']}"
        for stage, s in r["outer_rounds"].items()
    )
    print(
        f"{r['codec']:<6} {r['row']:<24} {losses:>17} {r['val_loss_mean']:>7.4f} {r['tokens']:>8} "
        f"{r['activation_bytes_per_token'] + r['gradient_bytes_per_token']:>9.1f} {r['pseudo_grad_bytes_per_token']:>8.3f} "
        f"{rounds:<32} {yes(r['hashes_agree_after_every_round']):>5} {yes(r['final_hashes_agree']):>5} {r['wall_s']:>6.0f}",
        flush=True,
    )


def main_real(args: argparse.Namespace) -> list[dict[str, Any]]:
    print(
        f"{'codec':<6} {'row':<24} {'val loss/replica':>17} {'mean':>7} {'tokens':>8} {'act B/tok':>9} {'pg B/tok':>8} "
        f"{'rounds: done/2 members/full peer':<32} {'each':>5} {'final':>5} {'wall s':>6}"
    )
    results = []
    for codec in args.codecs:
        for name, row in ROWS.items():
            results.append(run_real(name, row, codec, args))
            print_real(results[-1])
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    add_field_arguments(parser, SimulationConfig, "tokens", defaults={"tokens": 300_000})  # over both replicas
    add_field_arguments(parser, SwarmConfig, "outer.inner_steps", flags={"outer.inner_steps": ("--h",)})
    parser.add_argument("--codecs", nargs="+", default=["int8", "subspace"])
    parser.add_argument("--json", type=Path)
    real = parser.add_argument_group("--real: rows a, b, c as local swarms (one seed)")
    real.add_argument("--real", action="store_true", help="run real local swarms instead of the simulator")
    # per replica: a few past a round, so that none stops in the middle of its last round
    add_field_arguments(real, LocalSwarm, "steps", "stages", defaults={"steps": 205})
    real.add_argument("--config", type=Path, default=SMALL_MODEL, help="swarm config TOML (default: the small model)")
    add_field_arguments(real, PeerConfig, "data")
    real.add_argument("--out", type=Path, help="keep the swarms' logs and metrics here")
    args = parser.parse_args()
    if args.real:
        try:  # every row's layout and config, before any swarm starts
            for codec in args.codecs:
                for row in ROWS.values():
                    real_config(real_layout(row, stages=args.stages, steps=args.steps), row, codec, args)
        except ValueError as e:  # ConfigError is one
            parser.error(str(e))
        write_json(args, main_real(args))
        return
    corpus = load_corpus()
    results: list[dict[str, Any]] = []
    header = f"{'codec':<9} {'row':<31} {'val loss (mean ± std)':>22} {'act B/token':>11} {'pseudo B/token':>14}"
    print(header)
    for codec in args.codecs:
        for name, row in ROWS.items():
            started = time.perf_counter()
            runs = [run(codec, row, seed=seed, args=args, corpus=corpus) for seed in range(args.seeds)]
            losses = [r["val_loss"] for r in runs]
            summary = {
                "codec": codec,
                "row": name,
                **row,
                "val_loss_mean": statistics.mean(losses),
                "val_loss_std": statistics.stdev(losses) if len(losses) > 1 else 0.0,
                "val_losses": losses,
                "activation_bytes_per_token": statistics.mean(r["activation_bytes_per_token"] for r in runs),
                "pseudo_grad_bytes_per_token": statistics.mean(r["pseudo_grad_bytes_per_token"] for r in runs),
                "wall_s": time.perf_counter() - started,
            }
            results.append(summary)
            print(
                f"{codec:<9} {name:<31} {summary['val_loss_mean']:>13.4f} ± {summary['val_loss_std']:.4f} "
                f"{summary['activation_bytes_per_token']:>11.1f} {summary['pseudo_grad_bytes_per_token']:>14.3f}",
                flush=True,
            )
    write_json(args, results)


def write_json(args: argparse.Namespace, results: list[dict[str, Any]]) -> None:
    if args.json:
        args.json.write_text(
            json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=1)
        )
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
