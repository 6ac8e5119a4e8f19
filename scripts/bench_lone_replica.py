"""What should the outer step do for a replica alone in its stage? Measured, not assumed.

One replica per stage (the default ``swarmloco local`` layout), simulated in process on the
default config and corpus, at equal tokens, over several seeds:

- ``plain``: no outer step at all (``outer.method = "none"``), the reference;
- ``keep``: what swarmloco does: a round with nobody else leaves the weights alone
  (``OuterOptimizer.apply_alone``) — bitwise the same run as ``plain``, checked here;
- ``diloco-step``: the replica applies its own Δ through DiLoCo's Nesterov outer step
  (the DiLoCo scaling-law study's single-replica variant);
- ``sparseloco-step``: the replica applies its own top-k 2-bit Δ (what swarmloco did before).

    python scripts/bench_lone_replica.py --seeds 3 --json docs/data/bench-lone-replica.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

import torch

import swarm.sim.simulate as simulate_module
from peer.data import load_corpus
from swarm.config import SwarmConfig
from swarm.sim.simulate import Replica, SimulationConfig, simulate

VARIANTS = {"plain": "none", "keep": "sparseloco", "diloco-step": "diloco", "sparseloco-step": "sparseloco"}


def outer_step_on_own_delta(group: list[Replica]) -> int:
    """The rejected alternative: a lone replica's outer step applies its own (encoded) Δ."""
    for r in group:
        r.outer_step.apply([r.outer_step.make_payload(r.params)], r.params)
    return 0


def run(variant: str, seed: int, tokens: int, inner_steps: int, corpus) -> float:
    base = SwarmConfig()
    method = VARIANTS[variant]
    cfg = dataclasses.replace(
        base,
        train=dataclasses.replace(base.train, seed=seed),
        codecs=dataclasses.replace(base.codecs, pseudo_gradients="sparseloco" if method == "sparseloco" else "fp32"),
        outer=dataclasses.replace(base.outer, method=method, inner_steps=inner_steps),
    )
    t = cfg.train
    stream = corpus.sample_batches("train", batch_size=t.microbatch_size, seq_len=t.seq_len, seed=seed)
    val = corpus.val_batches(batch_size=t.microbatch_size, seq_len=t.seq_len)
    original = simulate_module.outer_round
    if variant.endswith("-step"):
        simulate_module.outer_round = outer_step_on_own_delta
    try:
        return simulate(
            cfg, SimulationConfig(replicas=1, tokens=tokens, seed=seed, log_every=10**9), [stream], val
        ).val_loss
    finally:
        simulate_module.outer_round = original


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--tokens", type=int, default=204_800, help="training tokens per run (the default swarmloco local's)"
    )
    parser.add_argument(
        "-H", "--inner-steps", type=int, default=SwarmConfig().outer.inner_steps, help="outer interval H"
    )
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--only", nargs="*", choices=list(VARIANTS), help="run only these variants")
    parser.add_argument("--data", nargs="*", help="corpus (default: the standard library's sources)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    torch.set_num_threads(2)
    corpus = load_corpus(args.data)
    losses: dict[str, list[float]] = {}
    for variant in args.only or VARIANTS:
        losses[variant] = [run(variant, seed, args.tokens, args.inner_steps, corpus) for seed in range(args.seeds)]
        print(f"{variant:<16} " + " ".join(f"{x:.4f}" for x in losses[variant]), flush=True)
    if "plain" in losses and "keep" in losses and losses["plain"] != losses["keep"]:
        print("warning: 'keep' differs from 'plain': a lone round changed the weights")
    ref = statistics.mean(losses["plain"]) if "plain" in losses else None
    print(f"\n{'variant':<16} {'val_loss mean':>13} {'stdev':>7} {'vs plain':>8}")
    rows = []
    for variant, xs in losses.items():
        mean, sd = statistics.mean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0
        ratio = mean / ref if ref else float("nan")
        rows.append({"variant": variant, "val_loss": xs, "mean": mean, "stdev": sd, "vs_plain": ratio})
        print(f"{variant:<16} {mean:13.4f} {sd:7.4f} {ratio:8.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"tokens": args.tokens, "inner_steps": args.inner_steps, "seeds": args.seeds, "rows": rows}, f, indent=1
            )
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
