"""Boundary codecs against fp32 at equal tokens: validation loss (mean ± sd over seeds) and bytes per token.

The model trains in one process, cut into stages as the swarm cuts it (``swarm/model/stages.py``); every boundary
(embedding → stage 1 → … → stage S → head) passes its forward activations through encode → decode of the
activation codec and its backward gradients through the gradient codec (``Boundary``, an autograd function), as a
swarm's hops would. Every codec pair trains on the same tokens and seeds as the fp32 baseline of the same run. Bytes
per token count both directions at every boundary, once each, before zstd (frames as ``Codec.round_trip`` sizes
them); the ``zstd`` column codes one sampled microbatch per ``--zstd-every`` steps fully and scales by what zstd saved.
A subspace pair trains the subspace-constrained model (``model.subspace_rank``): it is judged by its own loss.

    python scripts/bench_boundary.py --preset tiny --steps 250 --seeds 3 --pairs fp32 int8 rot4 rot2 rot1 rot2:rot1 \\
        --jobs 2 --json docs/data/boundary-codecs-tiny.json
    python scripts/bench_boundary.py --preset 20m --seq-len 256 --batch 4 --steps 120 --pairs fp32 rot2 rot2:rot1
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import statistics
import time
from typing import Any

import torch

from compress.codec_base import Codec
from compress.codecs import get_codec
from peer.data import Corpus, load_corpus
from swarm.cli_fields import add_field_arguments
from swarm.config import SwarmConfig, derive_config
from swarm.model.stages import EdgeStage, middle_stages
from swarm.model.step import InnerStep
from swarm.model.transformer import ModelConfig, Transformer, loss_fn, subspace_basis


class Link:
    """One boundary's codecs and the bytes that crossed it, by direction."""

    def __init__(self, act: Codec, grad: Codec, tokens: torch.Tensor | None) -> None:
        self.act, self.grad, self.tokens = act, grad, tokens
        self.sent = {"activations": 0, "gradients": 0}
        self.zstd = {"activations": [0, 0], "gradients": [0, 0]}  # sampled (bytes after zstd, bytes before)
        self.sample = False

    def code(self, kind: str, codec: Codec, x: torch.Tensor, tokens: torch.Tensor | None) -> torch.Tensor:
        y, nbytes = codec.round_trip(x, tokens)
        self.sent[kind] += nbytes
        if self.sample:
            self.zstd[kind][0] += len(codec.encode(x, tokens=tokens))
            self.zstd[kind][1] += nbytes
        return y


class Boundary(torch.autograd.Function):
    """Identity in autograd's eyes; forward and backward values cross the link's codecs."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, link: Link) -> torch.Tensor:  # noqa: D102
        ctx.link = link
        return link.code("activations", link.act, x, link.tokens)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: D102
        return ctx.link.code("gradients", ctx.link.grad, g, None), None


def codecs_for(pair: str, cfg: ModelConfig) -> tuple[Codec, Codec]:
    act, _, grad = pair.partition(":")
    basis, table = subspace_basis(cfg) if cfg.subspace_rank else (None, None)
    return get_codec(act, basis=basis, table=table), get_codec(grad or act, basis=basis, kind="gradient")


def config_for(args: argparse.Namespace, pair: str) -> SwarmConfig:
    overrides: dict[str, Any] = {"model.preset": args.preset, "train.seq_len": args.seq_len}
    overrides |= {"train.inner_batch": args.batch, "train.microbatch_size": args.batch}
    overrides |= {"inner.total_steps": args.steps, "stages.num_stages": args.stages}
    if args.warmup is not None:
        overrides["inner.warmup_steps"] = args.warmup
    if pair.startswith("subspace"):
        overrides["model.subspace_rank"] = args.subspace_rank
    return derive_config(SwarmConfig(), overrides)


def forward(edge: EdgeStage, middles: list, links: list[Link], inputs: torch.Tensor) -> torch.Tensor:
    h = edge.embed(inputs)
    for i, stage in enumerate(middles):
        links[i].tokens = inputs
        h = stage(Boundary.apply(h, links[i]))
    links[-1].tokens = inputs
    logits: torch.Tensor = edge.head(Boundary.apply(h, links[-1]))
    return logits


def run(args: argparse.Namespace, pair: str, seed: int, corpus: Corpus) -> dict[str, Any]:
    """One training run: the final validation loss through the codecs and without them, and the bytes sent."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(seed)
    cfg = config_for(args, pair)
    model_cfg = dataclasses.replace(cfg.model, init_seed=seed)
    model = Transformer(model_cfg)
    edge, middles = EdgeStage(model), middle_stages(model, cfg.stages.num_stages)
    act, grad = codecs_for(pair, model_cfg)
    links = [Link(act, grad, None) for _ in range(len(middles) + 1)]
    inner = InnerStep(model.parameters(), cfg.inner, inner_batch=args.batch)
    batches = corpus.sample_batches("train", batch_size=args.batch, seq_len=args.seq_len, seed=seed)
    started, tokens = time.perf_counter(), 0
    for step in range(args.steps):
        inputs, targets = next(batches)
        for link in links:
            link.sample = step % args.zstd_every == 0
        loss_fn(forward(edge, middles, links, inputs), targets).backward()
        inner.add(inputs.shape[0])
        tokens += inputs.numel()
    sent = {k: sum(link.sent[k] for link in links) for k in ("activations", "gradients")}  # training frames only
    zstd = {k: [sum(link.zstd[k][i] for link in links) for i in (0, 1)] for k in sent}
    val = corpus.val_batches(batch_size=args.batch, seq_len=args.seq_len, num_sequences=args.val_sequences)
    model.eval()
    with torch.no_grad():
        for link in links:
            link.sample = False
        coded = [float(loss_fn(forward(edge, middles, links, x), y)) for x, y in val]
        clean = [float(loss_fn(model(x), y)) for x, y in val]
    return {
        "pair": pair,
        "seed": seed,
        "tokens": tokens,
        "val_loss": statistics.fmean(coded),
        "val_loss_clean": statistics.fmean(clean),
        "train_bytes": sent,
        "zstd_saving": {k: 1 - v[0] / v[1] if v[1] else 0.0 for k, v in zstd.items()},
        "wall_s": time.perf_counter() - started,
    }


def bytes_per_token(record: dict[str, Any]) -> dict[str, float]:
    """Training frames per trained token, both directions, every boundary."""
    act = record["train_bytes"]["activations"] / record["tokens"]
    grad = record["train_bytes"]["gradients"] / record["tokens"]
    return {"activations": act, "gradients": grad, "total": act + grad}


def summarize(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    base = statistics.fmean(r["val_loss"] for r in records if r["pair"] == "fp32")
    base_bytes = statistics.fmean(bytes_per_token(r)["total"] for r in records if r["pair"] == "fp32")
    rows = []
    for pair in dict.fromkeys(r["pair"] for r in records):
        runs = [r for r in records if r["pair"] == pair]
        losses = [r["val_loss"] for r in runs]
        per_tok = bytes_per_token(runs[0])
        saving = runs[0]["zstd_saving"]
        zstd = per_tok["activations"] * (1 - saving["activations"]) + per_tok["gradients"] * (1 - saving["gradients"])
        rows.append(
            {
                "pair": pair,
                "seeds": len(runs),
                "val_loss": statistics.fmean(losses),
                "val_sd": statistics.stdev(losses) if len(losses) > 1 else 0.0,
                "val_loss_clean": statistics.fmean(r["val_loss_clean"] for r in runs),
                "loss_ratio": statistics.fmean(losses) / base,
                "bytes_per_token": per_tok,
                "ratio_vs_fp32": base_bytes / per_tok["total"],
                "zstd_bytes_per_token": zstd,
                "zstd_ratio_vs_fp32": base_bytes / zstd,
                "wall_s": statistics.fmean(r["wall_s"] for r in runs),
            }
        )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| act:grad | B/token (act + grad) | × below fp32 | zstd × | val loss (mean ± sd, seeds) | ratio | val, no codec |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: -r["bytes_per_token"]["total"]):
        b = r["bytes_per_token"]
        lines.append(
            f"| {r['pair']} | {b['total']:,.0f} ({b['activations']:,.0f} + {b['gradients']:,.0f}) "
            f"| {r['ratio_vs_fp32']:.1f} | {r['zstd_ratio_vs_fp32']:.1f} | {r['val_loss']:.4f} ± {r['val_sd']:.4f} ({r['seeds']}) "
            f"| {r['loss_ratio']:.4f} | {r['val_loss_clean']:.4f} |"
        )
    return "\n".join(lines)


SETTINGS = (
    "preset",
    "seq_len",
    "batch",
    "stages",
    "steps",
    "warmup",
    "subspace_rank",
    "val_sequences",
    "zstd_every",
    "threads",
)


def previous_runs(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The runs of ``--merge``, refused unless they trained as these would."""
    if not args.merge:
        return []
    with open(args.merge) as f:
        data = json.load(f)
    differ = [k for k in SETTINGS if data["args"].get(k) != getattr(args, k)]
    if differ or args.threads != 1:
        raise SystemExit(f"--merge {args.merge}: settings differ ({', '.join(differ) or 'threads ≠ 1'})")
    runs: list[dict[str, Any]] = data["runs"]
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_field_arguments(parser, SwarmConfig, "model.preset", "train.seq_len")
    parser.add_argument("--batch", type=int, default=16, help="sequences per step (one microbatch, one inner step)")
    add_field_arguments(parser, SwarmConfig, "stages.num_stages")  # stages + 1 boundaries
    parser.add_argument("--steps", type=int, default=250)
    parser.add_argument("--seeds", type=int, default=3)
    add_field_arguments(parser, SwarmConfig, "inner.warmup_steps", defaults={"inner.warmup_steps": None})
    parser.add_argument("--pairs", nargs="+", default=["fp32", "int8", "rot4", "rot2", "rot1"])
    add_field_arguments(parser, SwarmConfig, "model.subspace_rank", defaults={"model.subspace_rank": 16})
    parser.add_argument("--val-sequences", type=int, default=64)
    parser.add_argument("--zstd-every", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once (processes)")
    parser.add_argument("--json", help="write the runs and the summary here")
    parser.add_argument(
        "--merge", help="a previous --json of the same settings: its runs are kept, not rerun (1 thread: deterministic)"
    )
    parser.add_argument("--summarize", action="store_true", help="run nothing: the table of --merge's runs")
    args = parser.parse_args()
    if "fp32" not in args.pairs:
        args.pairs.insert(0, "fp32")
    corpus = load_corpus()
    records = previous_runs(args)
    done = {(r["pair"], r["seed"]) for r in records}
    jobs = [(pair, seed) for seed in range(args.seeds) for pair in args.pairs if (pair, seed) not in done]
    if args.summarize:
        jobs = []
    started = time.perf_counter()
    with concurrent.futures.ProcessPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(run, args, pair, seed, corpus) for pair, seed in jobs]
        for future in concurrent.futures.as_completed(futures):
            records.append(future.result())
            r = records[-1]
            print(f"{r['pair']:>12} seed {r['seed']}: val {r['val_loss']:.4f} ({r['wall_s']:.0f} s)", flush=True)
            save(args, records)  # after every run: a sweep stopped early keeps what it finished (--merge resumes)
    rows = save(args, records)
    print(table(rows))
    print(f"wall {time.perf_counter() - started:.0f} s")


def save(args: argparse.Namespace, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The summary of the runs so far of ``--pairs`` (once fp32 has one), written with every run (merged ones of other
    pairs too) to ``--json``."""
    order = {pair: i for i, pair in enumerate(dict.fromkeys([*args.pairs, *(r["pair"] for r in records)]))}
    records.sort(key=lambda r: (order[r["pair"]], r["seed"]))
    shown = [r for r in records if r["pair"] in args.pairs and r["seed"] < args.seeds]
    rows = summarize(shown) if any(r["pair"] == "fp32" for r in shown) else []
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "summary": rows, "runs": records}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
