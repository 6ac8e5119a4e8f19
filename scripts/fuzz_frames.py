"""Mutated frames through every receiver: the boundary codecs, SparseLoCo frames and the outer step's payloads.

Each case starts from a valid frame or payload and mutates it (bit flips, byte overwrites with
extreme values, truncation, extension, splices of two frames, a random header). A boundary codec's
frame is as often corrupted inside and sealed again with a valid checksum (``reseal``: its meta or
body overwritten with NaN, inf or huge floats, truncated or extended, its shape or dtype changed),
as a hostile sender would, so the codec's own decoding is reached, not only the frame's checks. A
boundary codec may refuse a frame with ``WireError`` only (decoding bytes from strangers raises
nothing else: compress/errors.py); each is decoded in turn as a trainer reads a reply (the shape it
expects) and as a stage server reads a request (its limits, no shape). The outer receivers may
refuse with ``WireError``/``ValueError`` (a clear error, a strike against the sender). A receiver
may accept a frame the mutation left valid; anything else raised is a crash. The outer step is
driven through ``OuterOptimizer.apply`` with one honest and one mutated payload, as a round would,
and its weights must stay finite. Peak traced memory is reported against the largest valid frame.

    python scripts/fuzz_frames.py --cases 12000 --json docs/data/fuzz.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import random
import time
import tracemalloc
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch

from compress.codec_base import BOUNDARY_MAX_ABS
from compress.codecs import get_codec
from compress.config import CodecConfig
from compress.errors import WireError
from compress.wire import DTYPES, WireLimits, decode_frame, encode_frame
from optim.config import OuterOptimConfig
from optim.factory import build_outer_optimizer

# every stateless boundary codec: cast, int, rotated (compress/rotated.py), low-rank (compress/lowrank.py)
BOUNDARY_CODECS = ("fp32", "fp16", "bf16", "int8", "int4", "rot4", "rot2", "rot1", "lowrank16", "lowrank32")
SHAPE = (4, 32, 64)  # (B, T, d) of the activations a receiver expects
# a stage server's bounds for a request of at most SHAPE (as swarm/pipeline/inbound.py's boundary_limits sets them)
SERVER_LIMITS = WireLimits(
    max_frame_bytes=4 * math.prod(SHAPE) + (64 << 10),
    max_body_bytes=4 * math.prod(SHAPE) + (64 << 10),
    max_elements=math.prod(SHAPE),
    max_ndim=3,
    max_abs=BOUNDARY_MAX_ABS,
)
# floats a hostile sender writes into a scale, a basis or a value: not finite, huge, negative, zero, subnormal
EXTREME_FLOATS = (math.nan, math.inf, -math.inf, 3.0e38, -1.0, 0.0, 1.0e-45, 65504.0, 1.0e30)
EXTREME_DIMS = (0, 1, 2, 63, 65, 4096, 1 << 20, 1 << 31, (1 << 32) - 1)
MAX_FITTED_BODY = 4 << 20  # ``reseal`` fits a body to a changed shape up to this size


@dataclass(frozen=True)
class Receiver:
    name: str
    frame: bytes  # a valid frame (or payload) to mutate
    receive: Callable[[bytes], object]
    refusals: tuple[type[Exception], ...]  # the clear errors: what a refusal may raise; anything else is a crash
    # a single frame: mutated inside as often as outside (``reseal``), given the meta + body bytes a shape needs
    payload_bytes: Callable[[tuple[int, ...]], int] | None = None


def mutate(frame: bytes, other: bytes, rng: random.Random) -> bytes:
    """One random corruption of ``frame`` (``other``: a second valid frame to splice from)."""
    data = bytearray(frame)
    kind = rng.randrange(6)
    if kind == 0:  # flip a few bits anywhere, the header included
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(len(data))
            data[i] ^= 1 << rng.randrange(8)
    elif kind == 1:  # extreme bytes over a run (huge lengths, scales, shapes)
        i = rng.randrange(len(data))
        data[i : i + rng.randint(1, 8)] = bytes([rng.choice((0x00, 0x7F, 0x80, 0xFF))] * rng.randint(1, 8))
    elif kind == 2:
        del data[rng.randrange(len(data)) :]
    elif kind == 3:
        data += rng.randbytes(rng.randint(1, 64))
    elif kind == 4:
        cut = rng.randrange(min(len(data), len(other)))
        data = data[:cut] + bytearray(other[cut:])
    else:
        data[: rng.randint(1, 32)] = rng.randbytes(rng.randint(1, 32))
    return bytes(data)


def corrupt(part: bytearray, rng: random.Random) -> bytearray:
    """One random corruption of a frame's meta or body: bit flips, an extreme float (fp32, fp16 or bf16) at an aligned
    offset, extreme bytes, truncation or extension."""
    kind = rng.randrange(5)
    if kind == 0 and part:
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(len(part))
            part[i] ^= 1 << rng.randrange(8)
    elif kind == 1:
        value = torch.tensor([rng.choice(EXTREME_FLOATS)]).to(
            rng.choice((torch.float32, torch.float16, torch.bfloat16))
        )
        coded = value.view(torch.uint8).numpy().tobytes()  # (beyond fp16's range: inf)
        i = rng.randrange(0, len(part) + 1, len(coded))
        part[i : i + len(coded)] = coded
    elif kind == 2 and part:
        i = rng.randrange(len(part))
        part[i : i + rng.randint(1, 8)] = bytes([rng.choice((0x00, 0x7F, 0x80, 0xFF))] * rng.randint(1, 8))
    elif kind == 3:
        del part[rng.randrange(len(part) + 1) :]
    else:
        part += rng.randbytes(rng.randint(1, 64))
    return part


def reseal(frame: bytes, payload_bytes: Callable[[tuple[int, ...]], int], rng: random.Random) -> bytes:
    """``frame`` corrupted inside (its meta, body, shape or dtype) and sealed again: checksum and sizes valid, so the
    frame's checks pass and the codec's own decoding meets the corruption. A changed shape comes as often with the
    body its codec needs for it (``payload_bytes``: meta + body), where that is at most MAX_FITTED_BODY bytes."""
    f = decode_frame(frame)
    meta, body, shape, dtype = bytearray(f.meta), bytearray(f.body), list(f.shape), f.dtype
    part = rng.randrange(4)
    if part == 0:
        meta = corrupt(meta, rng)
    elif part == 1:
        body = corrupt(body, rng)
    elif part == 2:  # a dim changed, added or dropped
        i, op = rng.randrange(len(shape) + 1), rng.randrange(3)
        if op == 0 and i < len(shape):
            shape[i] = rng.choice(EXTREME_DIMS)
        elif op == 1:
            shape.insert(i, rng.choice(EXTREME_DIMS))
        elif shape:
            del shape[min(i, len(shape) - 1)]
        needed = payload_bytes(tuple(shape)) - len(meta)
        if rng.random() < 0.5 and 0 <= needed <= MAX_FITTED_BODY:
            body = (body + bytearray(needed))[:needed]
    else:
        dtype = rng.choice(DTYPES)
    return encode_frame(f.codec_id, bytes(body), dtype=dtype, shape=tuple(shape), meta=bytes(meta))


def boundary_receivers() -> list[Receiver]:
    """Each boundary codec's decode, as a trainer (its expected shape) and a stage server (its limits) call it, in
    turn; it may refuse with ``WireError`` only, and what it accepts must be finite and within ``BOUNDARY_MAX_ABS``."""
    x = torch.randn(SHAPE)
    out = []
    for name in BOUNDARY_CODECS:
        codec = get_codec(name)
        sides = itertools.cycle(("trainer", "server"))

        def receive(frame: bytes, codec=codec, sides=sides) -> object:
            if next(sides) == "trainer":
                y = codec.decode(frame, expected_shape=SHAPE, limits=WireLimits(max_abs=BOUNDARY_MAX_ABS))
            else:
                y = codec.decode(frame, limits=SERVER_LIMITS)
            if not (y.dtype == torch.float32 and y.numel() <= math.prod(SHAPE) and all_within(y)):
                raise AssertionError(f"{codec.name} accepted a tensor it should refuse: {y.dtype} {tuple(y.shape)}")
            return "used"

        out.append(Receiver(f"activations/{name}", codec.encode(x), receive, (WireError,), codec.payload_bytes))
    return out


def all_within(y: torch.Tensor) -> bool:
    return y.numel() == 0 or float(y.abs().max()) <= BOUNDARY_MAX_ABS  # (NaN fails too)


def outer_receivers() -> list[Receiver]:
    """(name, a valid payload, receive) for DiLoCo, SparseLoCo and NoLoCo rounds of a small stage."""
    torch.manual_seed(0)
    stage = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.LayerNorm(96), torch.nn.Linear(96, 64))
    out = []
    for method, pseudo in (("diloco", "fp16"), ("sparseloco", "sparseloco"), ("noloco", "fp32")):
        cfg, codecs = OuterOptimConfig(method=method), CodecConfig(pseudo_gradients=pseudo)

        def replica() -> tuple[object, dict[str, torch.Tensor]]:
            local = {n: p.detach().clone() for n, p in stage.named_parameters()}
            return build_outer_optimizer(local, cfg, codecs), local

        honest, honest_local = replica()
        for p in honest_local.values():
            p.add_(0.01 * torch.randn_like(p))
        honest_payload = honest.make_payload(honest_local)
        sender, sender_local = replica()
        for p in sender_local.values():
            p.add_(0.01 * torch.randn_like(p))
        valid = sender.make_payload(sender_local)

        def receive(payload: bytes, method: str = method, make=replica, mine: bytes = honest_payload) -> object:
            opt, local = make()
            opt.make_payload({n: t + 0.01 for n, t in local.items()})
            screening = opt.apply([mine, payload], local)
            if not all(math.isfinite(float(t.abs().max())) for t in opt.global_params.values()):
                raise AssertionError(f"{method}: a mutated payload made the weights non-finite")
            return "dropped" if 1 in screening.dropped else "used"

        out.append(Receiver(f"outer/{method}", valid, receive, (ValueError, KeyError)))  # WireError, ConfigError too
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=12000, help="mutated frames in all (spread over the receivers)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the counts here")
    args = parser.parse_args()
    logging.disable(logging.WARNING)  # every dropped payload logs a warning; the counts say it
    rng = random.Random(args.seed)
    receivers = boundary_receivers() + outer_receivers()
    outcomes: dict[str, Counter[str]] = {r.name: Counter() for r in receivers}
    crashes: list[str] = []
    tracemalloc.start()
    started = time.perf_counter()
    for case in range(args.cases):
        receiver = receivers[case % len(receivers)]
        other = receivers[rng.randrange(len(receivers))].frame
        resealed = receiver.payload_bytes is not None and rng.random() < 0.5
        if receiver.payload_bytes is not None and resealed:
            mutated = reseal(receiver.frame, receiver.payload_bytes, rng)
        else:
            mutated = mutate(receiver.frame, other, rng)
        try:
            verdict = receiver.receive(mutated)  # outer rounds drop a bad payload and go on: "dropped"
            outcomes[receiver.name]["refused: dropped from the round" if verdict == "dropped" else "accepted"] += 1
        except receiver.refusals as e:  # refused with a reason
            outcomes[receiver.name][f"refused: {type(e).__name__}"] += 1
        except Exception as e:  # noqa: BLE001 — anything else is a crash of the receiver
            outcomes[receiver.name]["CRASH"] += 1
            crashes.append(f"{receiver.name}{' (resealed)' if resealed else ''}: {type(e).__name__}: {e}")
    peak_mb = tracemalloc.get_traced_memory()[1] / 2**20
    largest = max(len(r.frame) for r in receivers) / 2**20
    # past the checksum: refused by the frame's sizes or by the codec (a resealed frame always gets this far)
    print(f"{'receiver':<22} {'cases':>6} {'accepted':>8} {'refused':>8} {'crashes':>7} {'past checksum':>13}")
    for name, counts in outcomes.items():
        refused = sum(v for k, v in counts.items() if k.startswith("refused"))
        past = (
            refused
            - counts["refused: ChecksumMismatch"]
            - counts["refused: BadMagic"]
            - counts["refused: TruncatedFrame"]
        )
        shown = f"{past:>13}" if name.startswith("activations/") else f"{'—':>13}"  # outer refusals have no type here
        print(f"{name:<22} {sum(counts.values()):>6} {counts['accepted']:>8} {refused:>8} {counts['CRASH']:>7} {shown}")
    print(
        f"{args.cases} cases in {time.perf_counter() - started:.0f}s; {len(crashes)} crashes; traced peak {peak_mb:.1f} MB (largest valid frame {largest:.2f} MB)"
    )
    for line in crashes[:10]:
        print("  " + line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "outcomes": outcomes, "crashes": crashes, "peak_mb": peak_mb}, f, indent=1)


if __name__ == "__main__":
    main()
