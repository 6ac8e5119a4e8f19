"""``swarmloco export``: download a running swarm's model into one checkpoint file.

Joins the swarm's DHT as a client (it serves nothing), reads which peers serve each stage, downloads
every middle stage from one of its servers and stage 0 from a trainer (``swarm/export.py``), and
writes the checkpoint ``swarmloco eval`` and ``swarmloco sample`` load.

    $ swarmloco export --initial-peers /ip4/…/p2p/12D3… -o model.pt
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from swarm.config import SwarmConfig
from swarm.dht.start import watch_swarm
from swarm.export import download_model, export_sources
from swarm.outer.transfer import StageState
from swarm.pipeline.protocol import StageClient
from swarm.recovery.checkpoint import save_checkpoint
from swarm.rpc.admission import Credentials
from swarm.rpc.blobs import BlobClient


async def export_swarm(
    initial_peers: list[str],
    cfg: SwarmConfig | None,
    out: Path,
    *,
    name: str,
    identity_path: str | None = None,
    credentials: Credentials | None = None,
    timeout_s: float = 60.0,
    have: Mapping[int, StageState] | None = None,
    on_progress: Callable[[str], None] = lambda line: None,
) -> dict[str, Any]:
    """Write the swarm's current model to ``out`` (the stages in ``have`` from there, not the swarm); returns the
    checkpoint's metadata."""
    async with watch_swarm(
        initial_peers, cfg, name=name, identity_path=identity_path, credentials=credentials
    ) as membership:
        cfg = membership.cfg
        on_progress(
            f"swarm {cfg.swarm_id}: {cfg.stages.num_stages} middle stages + stage 0, {cfg.model.n_layers} blocks"
        )
        sources = export_sources(await membership.all_replicas(), cfg.stages.num_stages, have=have or {})
        p2p = await membership.dht.replicate_p2p()
        # private swarms: the certificate goes with each request
        certificate = StageClient(p2p, namespace=cfg.swarm_id, credentials=credentials).certificate
        client = BlobClient(p2p, namespace=cfg.swarm_id, certificate=certificate)
        fetch = lambda peer, blob, sink, max_bytes: client.stream(
            peer, blob, sink, timeout=timeout_s, max_bytes=max_bytes
        )
        model, meta = await download_model(cfg, sources, fetch, have=have, on_progress=on_progress)
    save_checkpoint(out, cfg, model, **meta)
    on_progress(f"wrote {out}: {sum(p.numel() for p in model.parameters()):,} parameters")
    return meta
