"""state-drain (issue 42, bounded serving): how much of a holder's upload one identity takes that downloads the stage's
state again and again, next to a clean run of the same holder, and what it costs the honest peers.

The holder is a real ``BlobServicer`` (its admission, budgets and byte buckets: ``ServingLimits``) on a ``FakeClock``,
serving real-size blobs through a model of its uplink: every tick the uplink's bytes are split evenly among the
identities with a stream open (one connection each: TCP shares a bottleneck between connections), and within an
identity among its streams. At real size, a 125m middle stage of 3 (28.3M parameters):

- the stage's two other replicas fetch the holder's payload (113 MB, a dense fp32 Δ) at each outer round, every
  ``--round-s`` seconds (the seed jitters when);
- a joiner downloads the stage's state (226 MB: the weights and the outer momentum) once, at 60 s (jittered);
- the drainer (attack runs only) asks for the state from t = 0, keeps up to 16 streams asked for, and asks again 1 s
  after each refusal.

The drainer's share is of the holder's upload capacity (uplink × duration) and of the bytes it sent; its fair share is
one of the identities served (4: two replicas, the joiner, the drainer). ``--limits``: ``bytes`` (``ServingLimits()``,
the default), ``count`` (the limits before the byte bound: 4 states then one a minute per identity, 16 streams of any
kind) or ``none`` (16 streams, nothing else: as issue 42 found it).

    nice -n 10 python3 scripts/bench_drain.py                   # the byte bound, 3 seeds: table on stdout
    nice -n 10 python3 scripts/bench_drain.py --limits count --seeds 1 --json /tmp/drain.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
from hivemind.p2p import P2PContext
from hivemind.proto import runtime_pb2

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from swarm.rpc.blobs import BlobRequest, BlobServicer, BlobStream, ServingLimits  # noqa: E402
from swarm.rpc.servicer import pack_envelope  # noqa: E402
from swarmtest.clock import FakeClock  # noqa: E402

STATE_BYTES = 226_000_000  # a 125m middle stage of 3: 28.3M fp32 weights and as many momentum values
PAYLOAD_BYTES = 113_000_000  # its dense fp32 Δ (DiLoCo's payload)
LIMITS = {
    "bytes": ServingLimits(),
    "count": ServingLimits(state_streams_per_peer=16, budgets=(("state", 4.0, 60.0),), upload_bytes_per_s=float("inf")),
    "none": ServingLimits(state_streams_per_peer=16, budgets=(), upload_bytes_per_s=float("inf")),
}


@dataclass
class Stream:
    """One blob a peer is receiving."""

    peer: str
    name: str
    replies: AsyncGenerator[runtime_pb2.ExpertResponse, None]
    started: float
    size: int = 0
    received: int = 0
    credit: float = 0.0  # bytes of uplink this stream may still take


@dataclass
class Holder:
    """The holder's blob service, its uplink and what it sent to whom."""

    servicer: BlobServicer
    clock: FakeClock
    uplink: float  # bytes/s
    streams: list[Stream] = field(default_factory=list)
    sent: Counter[str] = field(default_factory=Counter)
    done: list[tuple[str, str, float]] = field(default_factory=list)  # (peer, blob, seconds it took)
    refused: Counter[str] = field(default_factory=Counter)

    async def ask(self, peer: str, name: str) -> bool:
        """Ask for a blob; False if it was refused (its header an error)."""
        request = runtime_pb2.ExpertRequest(metadata=pack_envelope(BlobRequest(name=name)))
        replies = self.servicer.rpc_blob(request, P2PContext(handle_name="bench", local_id="holder", remote_id=peer))
        header = msgpack.unpackb((await anext(replies)).metadata)
        if "error" in header:
            self.refused[peer] += 1
            return False
        self.streams.append(Stream(peer, name, replies, self.clock.now, size=header["size"]))
        return True

    async def tick(self, dt: float) -> None:
        """``dt`` seconds of uplink, split evenly among the identities receiving, then among each one's streams."""
        peers = Counter(s.peer for s in self.streams)
        for stream in list(self.streams):
            stream.credit += self.uplink * dt / len(peers) / peers[stream.peer]
            while stream.credit > 0 and stream.received < stream.size:
                piece = len((await anext(stream.replies)).metadata)
                stream.received += piece
                stream.credit -= piece
                self.sent[stream.peer] += piece
            if stream.received >= stream.size:
                await anext(stream.replies)  # the trailer; then the client closes, as ``BlobClient`` does
                await stream.replies.aclose()
                self.streams.remove(stream)
                self.done.append((stream.peer, stream.name, self.clock.now + dt - stream.started))
        self.clock.advance(dt)

    def receiving(self, peer: str) -> int:
        return sum(s.peer == peer for s in self.streams)


def holder_with_blobs(limits: ServingLimits, clock: FakeClock, uplink: float) -> Holder:
    state, payload = bytes(STATE_BYTES), bytes(PAYLOAD_BYTES)

    def blob(data: bytes) -> BlobStream:
        async def chunks() -> AsyncIterator[bytes]:
            yield memoryview(data)  # the service sends it in 1 MiB pieces

        return BlobStream(size=len(data), chunks=chunks())

    async def provide(name: str) -> BlobStream:
        return blob(state if name.startswith("state/") else payload)

    servicer = BlobServicer(serving=limits, clock=clock)
    servicer.provide("state", provide)
    servicer.provide("outer", provide)
    return Holder(servicer, clock, uplink)


async def run(attack: bool, limits: ServingLimits, *, seed: int, duration_s: float, round_s: float) -> dict[str, Any]:
    """One run: the honest peers' fetches (and the drainer's) over ``duration_s`` simulated seconds."""
    rng, clock, dt = random.Random(seed), FakeClock(0.0), 0.05
    uplink = 12.5e6
    holder = holder_with_blobs(limits, clock, uplink)
    joiner_at = 60.0 + rng.uniform(-10, 10)
    rounds = {
        peer: [start + k * round_s for k in range(int(duration_s // round_s) + 1)]
        for peer, start in (("replica-1", rng.uniform(0, 20)), ("replica-2", rng.uniform(0, 20)))
    }
    retry_at, joined = 0.0, False
    while clock.now < duration_s:
        now = clock.now
        for peer, times in rounds.items():
            while times and times[0] <= now:
                await holder.ask(peer, f"outer/1/{int(times.pop(0) // round_s)}/payload/holder")
        if not joined and now >= joiner_at:
            joined = await holder.ask("joiner", "state/1") or False
        while attack and now >= retry_at and holder.receiving("drainer") < 16:
            if not await holder.ask("drainer", "state/1"):
                retry_at = now + 1.0
        await holder.tick(dt)
    capacity = uplink * duration_s
    total = sum(holder.sent.values())
    took = {peer: [s for p, _, s in holder.done if p == peer] for peer in ("joiner", "replica-1", "replica-2")}
    payloads = took["replica-1"] + took["replica-2"]
    return {
        "drainer_bytes": holder.sent["drainer"],
        "drainer_share_of_upload": holder.sent["drainer"] / capacity,
        "drainer_share_of_sent": holder.sent["drainer"] / total if total else 0.0,
        "drainer_states": sum(p == "drainer" for p, _, _ in holder.done),
        "drainer_refused": holder.refused["drainer"],
        "fair_share": 1 / (4 if attack else 3),
        "joiner_download_s": took["joiner"][0] if took["joiner"] else None,
        "payload_fetch_s_mean": sum(payloads) / len(payloads) if payloads else None,
        "payload_fetch_s_max": max(payloads) if payloads else None,
        "honest_bytes": total - holder.sent["drainer"],
        "counters": dict(holder.servicer.counters),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=600.0, help="simulated seconds")
    parser.add_argument("--round-s", type=float, default=120.0, help="seconds between outer rounds")
    parser.add_argument("--limits", choices=sorted(LIMITS), default="bytes", help="the holder's serving limits")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    limits = LIMITS[args.limits]
    rows = []
    for seed in range(args.seeds):
        for attack in (False, True):
            result = asyncio.run(run(attack, limits, seed=seed, duration_s=args.duration, round_s=args.round_s))
            rows.append({"seed": seed, "variant": "attack" if attack else "clean"} | result)
            print(json.dumps(rows[-1]), flush=True)
    print(f"\nlimits {args.limits} ({limits}), {args.duration:g} s at 12.5 MB/s:")
    print(
        f"{'seed':>4} {'variant':<7} {'drainer GB':>10} {'of upload':>9} {'of sent':>8} {'fair':>5} "
        f"{'joiner s':>8} {'payload s (mean/max)':>20}"
    )
    for r in rows:
        fetch = f"{fmt(r['payload_fetch_s_mean'])}/{fmt(r['payload_fetch_s_max'])}"
        print(
            f"{r['seed']:>4} {r['variant']:<7} {r['drainer_bytes'] / 1e9:>10.2f} {r['drainer_share_of_upload']:>9.1%} "
            f"{r['drainer_share_of_sent']:>8.1%} {r['fair_share']:>5.0%} {fmt(r['joiner_download_s']):>8} {fetch:>20}"
        )
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "args": vars(args) | {"json": str(args.json)}}, indent=1) + "\n")


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


if __name__ == "__main__":
    main()
