"""Rebuilding a lost stage in a running swarm: detection, one claimant at a time, download, CheckFree merge.

A lost stage is one with no live record whose neighbours have trained (``swarm_has_trained``); the peer that
wins its DHT claim (``acquire_claim``) downloads the neighbours as a catch-up would and merges them
(``rebuild_stage``; the math is ``checkfree.py``); it also reads and writes ``--stage-checkpoint`` files. More:
docs/architecture.md, recovery/.

    >>> rebuilt = await rebuild_stage(cfg, 2, outer_service.replicas, fetch)  # once acquire_claim(...) is won
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time

from swarm.config import PathConfig, SwarmConfig
from swarm.dht.membership import Membership
from swarm.dht.records import RecoveryClaim, StageStatus
from swarm.model.stages import EDGE_STAGE, split_layers, stage_template
from swarm.outer.claims import (
    LONE_CLAIM_MAX_NORM_RATIO,
    NEWCOMER_MAX_NORM_RATIO,
    check_plausible,
    newcomer_claims,
    stage_claims,
)
from swarm.outer.download import StreamFetch, download_claimed, download_state
from swarm.outer.state import StageState, pack_state, state_bytes_bound, unpack_state, weights_hash
from swarm.recovery.checkfree import RecoveryPlan, apply_recovery, recovery_source
from swarm.rpc.blobs import Sink, TransferError

logger = logging.getLogger(__name__)
PRIORITY_JOINER, PRIORITY_MOVER = 0, 1  # a peer that serves nothing yet rebuilds before one that must leave its stage
ReplicaReader = Callable[[int], Awaitable[Mapping[str, StageStatus]]]  # stage → {peer id: status}, this peer excluded
# (peer, blob name, sink, max bytes) → the blob's SHA-256 once it has streamed into the sink whole, or TransferError
BlobStreamer = Callable[[str, str, Sink, int], Awaitable[str]]


def claim_winner(claims: Mapping[str, RecoveryClaim]) -> str | None:
    """The peer whose claim stands: lowest priority, then smallest peer id (every peer computes the same)."""
    return min(claims, key=lambda peer: (claims[peer].priority, peer)) if claims else None


def empty_stages(replicas: Mapping[int, Mapping[Any, StageStatus]], num_stages: int) -> list[int]:
    """Middle stages 1..S with no live replica, lowest first."""
    return [stage for stage in range(1, num_stages + 1) if not replicas.get(stage)]


def swaps_enabled(paths: PathConfig) -> bool:
    """Whether paths swap adjacent stages, so stages 1 and S mimic their partners 2 and S−1 (CheckFree+)."""
    return paths.max_swaps > 0 and paths.swap_prob > 0


def swarm_has_trained(replicas: Mapping[int, Mapping[Any, StageStatus]]) -> bool:
    """Whether any replica (trainers included) has taken an inner or outer step: a stage missing now was lost, not never served."""
    return any(s.inner_steps > 0 or s.outer_round > 0 for peers in replicas.values() for s in peers.values())


async def acquire_claim(membership: Membership, stage: int, *, priority: int, ttl_s: float, settle_s: float) -> bool:
    """Claim the rebuild of ``stage``; True if this peer's claim stands after ``settle_s`` (it then rebuilds).

    Nobody claims over a live claim of another peer; peers that claimed at the same moment all see
    each other's claims after ``settle_s`` and agree on ``claim_winner``; the others withdraw.
    """
    me = membership.peer_id.to_base58()
    if any(peer != me for peer in _by_id(await membership.recovery_claims(stage))):
        return False
    mine = RecoveryClaim(priority=priority, claimed_at=get_dht_time())
    await membership.claim_recovery(stage, mine, expiration=get_dht_time() + ttl_s)
    await asyncio.sleep(settle_s)
    claims = _by_id(await membership.recovery_claims(stage)) | {me: mine}  # our own read may lag behind our store
    if claim_winner(claims) == me:
        return True
    await membership.withdraw_recovery(stage)
    logger.info(f"stage {stage}: {claim_winner(claims)} rebuilds it, not this peer")
    return False


def _by_id(claims: Mapping[PeerID, RecoveryClaim]) -> dict[str, RecoveryClaim]:
    return {peer.to_base58(): claim for peer, claim in claims.items()}


@dataclass(frozen=True, kw_only=True)
class Source:
    """One stage the rebuild read: whose state, the hash of the stream it came in, and its last gradient norm."""

    stage: int
    peer: str
    sha256: str  # of the state/<stage> or local/<stage> stream as served (hex); ``pack_state(state)`` gives those very bytes back
    state: StageState
    grad_norm: float  # from the peer's DHT record at download time
    vouched_by: int = 0  # replicas announcing the round state taken; 0: the peer's current weights, its word only

    def summary(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "peer": self.peer,
            "vouched_by": self.vouched_by,
            "sha256": self.sha256[:16],
            "weights_hash": weights_hash(self.state.params),
            "grad_norm": self.grad_norm,
            "schedule_step": self.state.schedule_step,
        }


@dataclass(frozen=True, kw_only=True)
class Rebuilt:
    """A stage rebuilt from its neighbours: the state to serve and what it came from."""

    plan: RecoveryPlan
    state: StageState  # round 0, no outer optimizer state: the rebuilt stage starts its own rounds
    sources: tuple[Source, ...]
    rebuild_s: float  # download + merge

    def event(self) -> dict[str, Any]:
        """The ``recovered`` log record's content: the merge inputs and the result's hash."""
        return {
            "stage": self.plan.stage,
            "kind": self.plan.kind,
            "sources": [s.summary() for s in self.sources],
            "weights_hash": weights_hash(self.state.params),
            "rebuild_s": self.rebuild_s,
        }


async def rebuild_stage(cfg: SwarmConfig, stage: int, replicas: ReplicaReader, fetch: BlobStreamer) -> Rebuilt:
    """Download the sources of ``stage`` and merge them; ``TransferError`` if a source stage has no replica that delivers."""
    started, num_stages = time.perf_counter(), cfg.stages.num_stages
    plan = recovery_source(stage, num_stages, swaps_enabled=swaps_enabled(cfg.paths))
    sources = []
    for source in plan.sources:
        try:
            sources.append(await _download_source(cfg, source, replicas, fetch))
        except TransferError as e:
            if plan.kind != "merge":
                raise
            # two adjacent stages lost at once
            logger.warning(f"stage {stage}: cannot merge, {e}; copying the other neighbour")
    if plan.kind == "merge" and len(sources) == 1:
        plan = RecoveryPlan(stage=stage, sources=(sources[0].stage,), kind="copy-neighbour")
    elif len(sources) < len(plan.sources):
        raise TransferError(f"stage {stage}: no neighbour delivered its state")
    by_stage = {s.stage: s for s in sources}
    num_blocks = len(split_layers(cfg.model.n_layers, num_stages)[stage - 1])
    merged = apply_recovery(plan, lambda s: (by_stage[s].state.params, by_stage[s].grad_norm), num_blocks=num_blocks)
    params = {
        name: merged[name] for name in stage_template(cfg.model, num_stages, stage)
    }  # the stage's own order (unpack_state checks it)
    # the sources' point on the lr schedule: the rebuilt stage continues there instead of warming up again
    state = StageState(
        stage=stage, round=0, schedule_step=max(s.state.schedule_step for s in sources), params=params, optimizer=None
    )
    return Rebuilt(plan=plan, state=state, sources=tuple(sources), rebuild_s=time.perf_counter() - started)


async def _download_source(cfg: SwarmConfig, stage: int, replicas: ReplicaReader, fetch: BlobStreamer) -> Source:
    """The state of source ``stage`` to rebuild from: the stage's vouched round state where it has one (exactly the
    claimed weights, as a catch-up takes them), else a replica's current weights that another replica's bear out."""
    if stage == EDGE_STAGE:
        raise ValueError("middle stages are rebuilt from middle stages")
    found = await replicas(stage)
    template = stage_template(cfg.model, cfg.stages.num_stages, stage)
    digests: dict[str, str] = {}  # the rebuild's inputs are logged and saved by their hash

    async def fetch_kept(peer: str, name: str, sink: Sink) -> str:
        digests[peer] = await fetch(peer, name, sink, state_bytes_bound(template))
        return digests[peer]

    vouched = [claim for claim in newcomer_claims(stage_claims(found)) if claim.vouched]
    if vouched:
        claim, peer, state = await download_claimed(
            fetch_kept, vouched, stage=stage, template=template, check_for=lambda claim: claim.check
        )
        vouched_by = len(claim.holders)
    else:
        peer, state = await _borne_out_local(fetch_kept, found, stage=stage, template=template)
        vouched_by = 0
    return Source(
        stage=stage,
        peer=peer,
        sha256=digests[peer],
        state=state,
        grad_norm=found[peer].grad_norm,
        vouched_by=vouched_by,
    )


async def _borne_out_local(
    fetch: StreamFetch, found: Mapping[str, StageStatus], *, stage: int, template: Mapping[str, torch.Tensor]
) -> tuple[str, StageState]:
    """A replica's current weights (``local/<stage>``; the most advanced replica first) when no claim is vouched for.

    One peer's word, so checked as far as it can be: its tensor norms must stay within
    ``NEWCOMER_MAX_NORM_RATIO`` of the seeded ones, and within ``LONE_CLAIM_MAX_NORM_RATIO`` of another replica's
    that passes the same check, where one delivers. Two replicas that disagree beyond that both go unused: neither
    can be told from a liar.
    """
    order = sorted(found, key=lambda p: (-found[p].outer_round, p))
    delivered: dict[str, StageState | None] = {}  # peer → its current weights; None: failed or far from the seeded
    failures: dict[str, str] = {}
    seeded = lambda state: check_plausible(state.params, template, max_norm_ratio=NEWCOMER_MAX_NORM_RATIO)

    def blame(peer: str, why: str) -> None:  # a peer's first reason stays
        failures.setdefault(peer, why)

    async def local(peer: str) -> StageState | None:  # each replica is asked once
        if peer not in delivered:
            try:
                _, delivered[peer] = await download_state(
                    fetch, [peer], stage=stage, template=template, blob="local", check=seeded, blame=blame
                )
            except TransferError as e:
                delivered[peer] = None
                failures.setdefault(peer, str(e))  # a transfer failure; a refused state's reason is in already
        return delivered[peer]

    for peer in order:
        if (state := await local(peer)) is None:
            continue
        references, problem = 0, ""
        for other in order:
            if other == peer or (reference := await local(other)) is None:
                continue
            references += 1
            try:
                check_plausible(state.params, reference.params, max_norm_ratio=LONE_CLAIM_MAX_NORM_RATIO)
                return peer, state  # another replica bears it out
            except ValueError as e:
                problem = str(e)
        if not references:
            return peer, state  # the only replica that delivers: its word, near the seeded norms, is all there is
        failures[peer] = f"its weights differ from every other replica's ({problem})"
    raise TransferError(
        f"no replica of stage {stage} delivered plausible weights "
        f"({'; '.join(f'{peer}: {why}' for peer, why in failures.items()) or 'no replica to ask'})"
    )


def save_rebuild(rebuilt: Rebuilt, directory: Path, name: str) -> Path:
    """Write the merge inputs (the source blobs as served, their gradient norms) and the result: anyone can redo the merge."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"recovery-stage{rebuilt.plan.stage}-{name}-{int(time.time() * 1000)}.pt"
    torch.save(
        {
            "stage": rebuilt.plan.stage,
            "kind": rebuilt.plan.kind,
            "sources": [
                # the state stream as served (its encoding is canonical: the decoder refuses any other)
                {"stage": s.stage, "peer": s.peer, "blob": pack_state(s.state), "grad_norm": s.grad_norm}
                for s in rebuilt.sources
            ],
            "params": rebuilt.state.params,
        },
        path,
    )
    return path


async def save_stage_checkpoint(path: Path, state: StageState) -> None:
    """Write a stage state file (``--stage-checkpoint``) off the event loop; atomic: a kill mid-write leaves the last one."""
    blob = pack_state(state)
    tmp = path.with_suffix(path.suffix + ".tmp")
    await asyncio.get_running_loop().run_in_executor(None, tmp.write_bytes, blob)
    tmp.replace(path)


def load_stage_checkpoint(path: Path, cfg: SwarmConfig, stage: int) -> StageState:
    """A stage state written by a server's periodic checkpoint (``--stage-checkpoint``), checked against the stage."""
    return unpack_state(
        path.read_bytes(), stage=stage, template=stage_template(cfg.model, cfg.stages.num_stages, stage)
    )
