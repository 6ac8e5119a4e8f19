"""Mutated frames through every receiver: activation codecs, SparseLoCo frames and the outer step's payloads.

Each case starts from a valid frame or payload and mutates it (bit flips, byte overwrites with
extreme values, truncation, extension, splices of two frames, a random header). A receiver may
refuse it with ``WireError``/``ValueError`` (a clear error, a strike against the sender) or accept
it when the mutation left it valid; anything else raised is a crash. The outer step is driven
through ``OuterOptimizer.apply`` with one honest and one mutated payload, as a round would, and
its weights must stay finite. Peak traced memory is reported against the largest valid frame.

    python scripts/fuzz_frames.py --cases 12000 --json docs/data/fuzz.json
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import time
import tracemalloc
from collections import Counter
from collections.abc import Callable

import torch

from compress.codecs import get_codec
from compress.config import CodecConfig
from optim.config import OuterOptimConfig
from optim.factory import build_outer_optimizer

ACTIVATION_CODECS = ("fp32", "fp16", "bf16", "int8", "int4")
SHAPE = (4, 32, 64)  # (B, T, d) of the activations a receiver expects


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


def activation_receivers() -> list[tuple[str, bytes, Callable[[bytes], object]]]:
    x = torch.randn(SHAPE)
    out = []
    for name in ACTIVATION_CODECS:
        codec = get_codec(name)
        out.append((f"activations/{name}", codec.encode(x), lambda f, c=codec: c.decode(f, expected_shape=SHAPE)))
    return out


def outer_receivers() -> list[tuple[str, bytes, Callable[[bytes], object]]]:
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

        out.append((f"outer/{method}", valid, receive))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=12000, help="mutated frames in all (spread over the receivers)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the counts here")
    args = parser.parse_args()
    logging.disable(logging.WARNING)  # every dropped payload logs a warning; the counts say it
    rng = random.Random(args.seed)
    receivers = activation_receivers() + outer_receivers()
    outcomes: dict[str, Counter[str]] = {name: Counter() for name, _, _ in receivers}
    crashes: list[str] = []
    tracemalloc.start()
    started = time.perf_counter()
    for case in range(args.cases):
        name, frame, receive = receivers[case % len(receivers)]
        _, other, _ = receivers[rng.randrange(len(receivers))]
        try:
            verdict = receive(mutate(frame, other, rng))  # outer rounds drop a bad payload and go on: "dropped"
            outcomes[name]["refused: dropped from the round" if verdict == "dropped" else "accepted"] += 1
        except (ValueError, KeyError) as e:  # WireError and ConfigError are ValueErrors: refused with a reason
            outcomes[name][f"refused: {type(e).__name__}"] += 1
        except Exception as e:  # noqa: BLE001 — anything else is a crash of the receiver
            outcomes[name]["CRASH"] += 1
            crashes.append(f"{name}: {type(e).__name__}: {e}")
    peak_mb = tracemalloc.get_traced_memory()[1] / 2**20
    largest = max(len(frame) for _, frame, _ in receivers) / 2**20
    print(f"{'receiver':<22} {'cases':>6} {'accepted':>8} {'refused':>8} {'crashes':>7}")
    for name, counts in outcomes.items():
        refused = sum(v for k, v in counts.items() if k.startswith("refused"))
        print(f"{name:<22} {sum(counts.values()):>6} {counts['accepted']:>8} {refused:>8} {counts['CRASH']:>7}")
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
