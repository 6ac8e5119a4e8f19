"""Codec benchmark on realistic tensors: size, error and speed of every codec against baselines.

Tensors, all from the default corpus (the stdlib sources) after 30 AdamW steps of training:

- ``act/default``, ``grad/default``: the activations (16×128×128) between middle stages 2 and 3
  of the default model, and the loss gradient arriving there on the way back;
- ``act/subspace``, ``grad/subspace``: the same for ``ModelConfig(subspace_rank=16)`` (d/k = 8);
  gradient errors there are measured in ``U.T @ g``, the only part any parameter sees;
- ``pseudo/default``: θ before − θ after the 30 steps, every parameter, one frame per tensor.

Baselines measured in the same run: zstd of the fp32 bytes, and hivemind's Float16Compression
and Uniform8BitQuantization. Throughputs are fp32 MB coded per second on one CPU thread,
medians over repeats. Also reported: SparseLoCo's bits per index against 12-bit packing, and
its value code against a 4-centroid bucket-mean codebook on the same kept values.

    python scripts/bench_codecs.py --json bench_codecs.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import zstandard
from hivemind.compression import CompressionInfo, Float16Compression, Uniform8BitQuantization
from hivemind.proto import runtime_pb2

from compress.codec_base import to_bytes
from compress.codecs import get_codec
from compress.sparseloco import SparseLoCoCodec, SparseLoCoState
from compress.wire import decode_frame
from optim.inner import clip_and_step, make_inner_optimizer
from peer.data import load_corpus
from swarm.config import SwarmConfig
from swarm.model.stages import split_layers
from swarm.model.transformer import ModelConfig, Transformer, loss_fn, subspace_basis

Tensors = dict[str, torch.Tensor]
Encode = Callable[[str, torch.Tensor], bytes]
Decode = Callable[[str, bytes], torch.Tensor]


@dataclass
class Record:
    codec: str
    tensor: str
    ratio: float  # fp32 bytes / wire bytes
    rel_error: float  # ‖decoded − x‖ / ‖x‖ over all tensors of the set
    bits_per_param: float
    encode_MBps: float
    decode_MBps: float


@dataclass
class TensorSet:
    name: str
    tensors: Tensors
    tokens: torch.Tensor | None = None  # (B, T) token ids, for subspace activations
    project: torch.Tensor | None = None  # measure errors in x @ project (subspace gradients)


def seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(ts: TensorSet, codecs: list[tuple[str, Encode, Decode]], repeats: int) -> list[Record]:
    """One record per codec; repeats are interleaved across codecs so machine load hits them alike."""
    frames = {name: {n: enc(n, x) for n, x in ts.tensors.items()} for name, enc, _ in codecs}
    times: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name, _, _ in codecs}
    for _ in range(repeats):
        for name, enc, dec in codecs:
            times[name][0].append(seconds(lambda: [enc(n, x) for n, x in ts.tensors.items()]))
            times[name][1].append(seconds(lambda: [dec(n, f) for n, f in frames[name].items()]))
    view = (lambda t: t @ ts.project) if ts.project is not None else (lambda t: t)
    numel = sum(x.numel() for x in ts.tensors.values())
    ref = sum(float(view(x.float()).norm() ** 2) for x in ts.tensors.values())
    records = []
    for name, _, dec in codecs:
        err = sum(
            float((view(dec(n, f).reshape(ts.tensors[n].shape)) - view(ts.tensors[n].float())).norm() ** 2)
            for n, f in frames[name].items()
        )
        wire = sum(len(f) for f in frames[name].values())
        mb, (enc_s, dec_s) = 4 * numel / 1e6, map(statistics.median, times[name])
        records.append(
            Record(name, ts.name, 4 * numel / wire, math.sqrt(err / ref), 8 * wire / numel, mb / enc_s, mb / dec_s)
        )
    return records


def ours(
    name: str,
    ts: TensorSet,
    basis: torch.Tensor | None = None,
    table: torch.Tensor | None = None,
    kind: str = "activation",
) -> tuple[str, Encode, Decode]:
    codec = get_codec(name, basis=basis, table=table, kind=kind)
    return name, lambda n, x: codec.encode(x, tokens=ts.tokens), lambda n, f: codec.decode(f)


def baselines() -> list[tuple[str, Encode, Decode]]:
    def hivemind(
        comp: Float16Compression | Uniform8BitQuantization, extract: Callable[[runtime_pb2.Tensor], torch.Tensor]
    ) -> tuple[Encode, Decode]:
        enc = lambda n, x: comp.compress(x, CompressionInfo.from_tensor(x)).SerializeToString()
        return enc, lambda n, f: extract(runtime_pb2.Tensor.FromString(f))

    def uniform8_extract(msg: runtime_pb2.Tensor) -> torch.Tensor:
        # hivemind 1.1.12's Quantization.extract calls int() on a 1-element array, which numpy 2
        # refuses; this is the same codebook lookup
        size = int(np.frombuffer(msg.buffer, dtype=np.int64, count=1)[0])
        codebook = torch.from_numpy(np.frombuffer(msg.buffer, np.float32, size, offset=8).copy())
        indices = torch.from_numpy(np.frombuffer(msg.buffer, np.uint8, offset=8 + 4 * size).copy())
        return codebook[indices.long()].reshape(tuple(msg.size))

    zstd_enc = lambda n, x: zstandard.ZstdCompressor(level=3).compress(to_bytes(x.float()))
    zstd_dec = lambda n, f: torch.frombuffer(
        bytearray(zstandard.decompress(f)), dtype=torch.float32
    )  # flat; measure() reshapes
    f16 = Float16Compression()
    return [
        ("zstd-fp32", zstd_enc, zstd_dec),
        ("hivemind-fp16", *hivemind(f16, f16.extract)),
        ("hivemind-uint8", *hivemind(Uniform8BitQuantization(), uniform8_extract)),
    ]


def train(cfg: ModelConfig, batches, steps: int) -> tuple[Transformer, Tensors]:
    """The model after ``steps`` AdamW steps, and θ_before − θ_after (a pseudo-gradient)."""
    swarm = SwarmConfig(model=cfg)
    model = Transformer(cfg)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt, sched = make_inner_optimizer(model.parameters(), swarm.inner)
    for _ in range(steps):
        x, y = next(batches)
        loss_fn(model(x), y).backward()
        clip_and_step(opt, sched, swarm.inner.grad_clip)
    return model, {n: before[n] - p.detach() for n, p in model.named_parameters()}


def boundary(model: Transformer, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(activations, loss gradient) between middle stages 2 and 3 of the default 4-stage split."""
    cut = split_layers(model.cfg.n_layers, SwarmConfig().stages.num_stages)[1].stop
    with torch.no_grad():
        h = model.run_blocks(model.embed(x), range(cut))
    h.requires_grad_()
    loss_fn(model.lm_head(model.norm(model.run_blocks(h, range(cut, model.cfg.n_layers)))), y).backward()
    return h.detach(), h.grad


def sparseloco_detail(pseudo: Tensors) -> dict[str, float]:
    """Bits per index, and the 2-bit value code against bucket-mean codebooks, on the same kept values."""
    codec = SparseLoCoCodec()
    kept = index_bits = 0
    err = {"sign_magnitude_per_tile": 0.0, "bucket_mean_per_tensor": 0.0, "bucket_mean_per_tile": 0.0}
    ref = 0.0
    for name, delta in pseudo.items():
        frame = codec.encode(name, delta, codec.new_state())
        sparse = codec.decode(frame)
        m = len(sparse.indices)
        index_bits += 8 * len(
            zstandard.ZstdCompressor(level=1).compress(decode_frame(frame).body[: 2 * m])
        )  # the delta byte planes
        kept += m
        exact = delta.reshape(-1)[sparse.indices]
        if delta.ndim >= 2:
            cols = delta[0].numel()
            tile = (sparse.indices // cols // 64) * -(-cols // 64) + sparse.indices % cols // 64
        else:
            tile = sparse.indices // 4096
        err["sign_magnitude_per_tile"] += float((sparse.values - exact).norm() ** 2)
        err["bucket_mean_per_tensor"] += float((bucket_means(exact, torch.zeros_like(tile)) - exact).norm() ** 2)
        err["bucket_mean_per_tile"] += float((bucket_means(exact, tile) - exact).norm() ** 2)
        ref += float(exact.norm() ** 2)
    return {"bits_per_index": index_bits / kept, "bits_per_index_fixed": 12.0} | {
        f"value_rel_error_{k}": math.sqrt(v / ref) for k, v in err.items()
    }


def bucket_means(values: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """Each value replaced by the mean of its quartile bucket within its group (4 centroids per group)."""
    out = torch.empty_like(values)
    for g in group.unique():
        v = values[group == g]
        bucket = torch.bucketize(v, torch.quantile(v, torch.tensor([0.25, 0.5, 0.75])))
        means = torch.zeros(4).index_add_(0, bucket, v) / torch.bincount(bucket, minlength=4).clamp(min=1)
        out[group == g] = means[bucket]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, help="write the records here")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--steps", type=int, default=30, help="AdamW steps before measuring")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)

    corpus, swarm = load_corpus(), SwarmConfig()
    batches = corpus.sample_batches(
        "train", batch_size=swarm.train.microbatch_size, seq_len=swarm.train.seq_len, seed=0
    )
    default, pseudo = train(swarm.model, batches, args.steps)
    sub_cfg = ModelConfig(subspace_rank=16)
    constrained, _ = train(sub_cfg, batches, args.steps)
    x, y = next(
        corpus.sample_batches("val", batch_size=swarm.train.microbatch_size, seq_len=swarm.train.seq_len, seed=1)
    )
    h, g = boundary(default, x, y)
    hs, gs = boundary(constrained, x, y)
    basis, table = subspace_basis(sub_cfg)

    act, grad = TensorSet("act/default", {"h": h}), TensorSet("grad/default", {"g": g})
    act_s, grad_s = TensorSet("act/subspace", {"h": hs}, tokens=x), TensorSet("grad/subspace", {"g": gs}, project=basis)
    pseudo_set = TensorSet("pseudo/default", pseudo)
    sparse, sparse_state = (
        SparseLoCoCodec(),
        SparseLoCoState(),
    )  # the first encode (the measured frames) starts from e = 0
    plan = [
        (act, [ours(n, act) for n in ("fp32", "fp16", "bf16", "int8", "int4")] + baselines()),
        (grad, [ours(n, grad) for n in ("fp16", "bf16", "int8", "int4")] + baselines()),
        (
            act_s,
            [ours(n, act_s, basis, table) for n in ("int8", "subspace", "subspace+int8", "subspace+int4")]
            + baselines(),
        ),
        (
            grad_s,
            [ours(n, grad_s, basis, kind="gradient") for n in ("int8", "subspace", "subspace+int8", "subspace+int4")]
            + baselines(),
        ),
        (
            pseudo_set,
            [("sparseloco", lambda n, d: sparse.encode(n, d, sparse_state), lambda n, f: sparse.decode(f).to_dense())]
            + [ours(n, pseudo_set) for n in ("fp16", "bf16")]
            + baselines(),
        ),
    ]
    records = [r for ts, codecs in plan for r in measure(ts, codecs, args.repeats)]
    detail = sparseloco_detail(pseudo)

    print(
        f"{'tensor':<15} {'codec':<15} {'ratio':>8} {'rel_error':>10} {'bits/param':>10} {'enc MB/s':>9} {'dec MB/s':>9}"
    )
    for r in records:
        print(
            f"{r.tensor:<15} {r.codec:<15} {r.ratio:8.2f} {r.rel_error:10.2e} {r.bits_per_param:10.3f} {r.encode_MBps:9.1f} {r.decode_MBps:9.1f}"
        )
    print("SparseLoCo detail:", ", ".join(f"{k}={v:.3f}" for k, v in detail.items()))
    if args.json:
        args.json.write_text(json.dumps({"records": [asdict(r) for r in records], "sparseloco": detail}, indent=1))


if __name__ == "__main__":
    main()
