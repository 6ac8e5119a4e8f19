"""A 125M-style stage's state downloaded between two real peers on loopback: the downloader's peak RSS and the time.

A server process holds one middle stage of a 125M-style model (d_model 768, 12 layers, 12 heads, 2
middle stages: 6 blocks, ~42M parameters, ~170 MB in fp32) and serves it two ways; a downloader,
each time a fresh process (a clean RSS), builds its own copy of the stage (a peer that downloads
holds its stage already) and downloads the state once:

- ``stream``: today's path, ``download_state`` over ``BlobClient.stream``: the server serializes
  chunk by chunk (``stream_state``), the receiver decodes each chunk straight into the state's
  tensors (``StateDecoder``).
- ``whole``: the path before streaming, kept callable here: the server sends a ``torch.save``
  archive built whole, the receiver collects the chunks, joins them and ``torch.load``s the archive.

Per mode: ``peak_rss_increase_mb`` (the downloader's peak resident memory during the download over
its resident memory just before: what the download costs besides the stage it already holds;
the state it builds, one stage, is part of it either way), ``download_s`` and the stage's size.

    python scripts/bench_state_download.py --json bench-state-download.json     # ~1 min on 2 cores
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from hivemind.p2p import P2P, PeerID

from swarm.model.stages import stage_template
from swarm.model.transformer import ModelConfig
from swarm.outer.download import download_state
from swarm.outer.state import StageState, state_bytes_bound, stream_state
from swarm.rpc.blobs import BlobClient, BlobServicer

MODEL = ModelConfig(d_model=768, n_layers=12, n_heads=12)  # explicit dims, 125M-style
NUM_STAGES, STAGE = 2, 1
NAMESPACE = "bench"


def template() -> dict[str, torch.Tensor]:
    return {name: p.detach() for name, p in stage_template(MODEL, NUM_STAGES, STAGE).items()}


def vm_kb(field: str) -> int:
    """A ``VmRSS``/``VmHWM`` line of /proc/self/status, in kB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


async def serve() -> None:
    """The server: one stage state, served as a stream (``state/1``) and as one torch archive (``whole/1``)."""
    params = template()
    state = StageState(stage=STAGE, round=3, schedule_step=100, params=params, optimizer=None)
    buffer = io.BytesIO()  # the old format: what the server built (and kept) before streaming
    torch.save(
        {"format": "swarmloco-stage-state-v1", "stage": STAGE, "round": 3, "schedule_step": 100}
        | {"params": params, "optimizer": None},
        buffer,
    )
    archive = buffer.getvalue()
    p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    servicer = BlobServicer()
    servicer.provide("state", lambda name: asyncio.sleep(0, stream_state(state)))
    servicer.provide("whole", lambda name: asyncio.sleep(0, archive))
    await servicer.add_p2p_handlers(p2p, namespace=NAMESPACE)
    maddrs = [str(m) for m in await p2p.get_visible_maddrs()]
    print(json.dumps({"peer": p2p.peer_id.to_base58(), "maddrs": maddrs}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent closes stdin
    await p2p.shutdown()


class CollectingSink:
    """The receiver before streaming: every chunk kept, then joined (``BlobClient._read`` of the base commit)."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def open(self, size: int) -> None:
        pass

    def write(self, chunk: bytes) -> None:
        self.parts.append(chunk)


async def download(mode: str, peer: str, maddrs: list[str]) -> dict[str, Any]:
    """One download in this (fresh) process; the peak RSS over the baseline taken just before it."""
    own = template()  # this peer's own stage: what a state is checked against and then adopted into
    p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=maddrs)
    server = PeerID.from_base58(peer)
    client = BlobClient(p2p, namespace=NAMESPACE)
    bound = state_bytes_bound(own)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    baseline = vm_kb("VmRSS")
    started = time.perf_counter()
    if mode == "stream":
        fetch = lambda peer, name, sink: client.stream(server, name, sink, timeout=300, max_bytes=bound)
        _, state = await download_state(fetch, [peer], stage=STAGE, template=own)
        params = state.params
    else:
        sink = CollectingSink()
        await client.stream(server, f"whole/{STAGE}", sink, timeout=300, max_bytes=bound)
        data = b"".join(sink.parts)
        params = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)["params"]
    elapsed = time.perf_counter() - started
    peak = vm_kb("VmHWM")
    assert all(torch.equal(params[name], own[name]) for name in own)  # seeded alike: the same weights
    await p2p.shutdown()
    return {
        "mode": mode,
        "stage_mb": round(4 * sum(t.numel() for t in own.values()) / 1e6, 1),
        "params_m": round(sum(t.numel() for t in own.values()) / 1e6, 1),
        "baseline_rss_mb": round(baseline / 1024, 1),
        "peak_rss_increase_mb": round((peak - baseline) / 1024, 1),
        "download_s": round(elapsed, 2),
    }


def run_downloader(mode: str, server: dict[str, Any]) -> dict[str, Any]:
    command = [sys.executable, __file__, "--role", "download", "--mode", mode, "--server", json.dumps(server)]
    out = subprocess.run(command, check=True, capture_output=True, text=True, env=os.environ)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--role", choices=["main", "serve", "download"], default="main", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=["stream", "whole"], help=argparse.SUPPRESS)
    parser.add_argument("--server", help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=1, help="downloads per mode (each in a fresh process)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.role == "serve":
        asyncio.run(serve())
        return
    if args.role == "download":
        server = json.loads(args.server)
        print(json.dumps(asyncio.run(download(args.mode, server["peer"], server["maddrs"]))))
        return
    server_process = subprocess.Popen(
        [sys.executable, __file__, "--role", "serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        server = json.loads(server_process.stdout.readline())
        results = [run_downloader(mode, server) for _ in range(args.repeats) for mode in ("stream", "whole")]
    finally:
        server_process.stdin.close()
        server_process.wait(timeout=30)
    columns = ["mode", "params_m", "stage_mb", "baseline_rss_mb", "peak_rss_increase_mb", "download_s"]
    print(" ".join(f"{c:>20}" for c in columns))
    for row in results:
        print(" ".join(f"{row[c]!s:>20}" for c in columns))
    if args.json:
        args.json.write_text(json.dumps({"model": vars(MODEL), "results": results}, indent=2))


if __name__ == "__main__":
    main()
