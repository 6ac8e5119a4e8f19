"""Export: the whole model out of a running swarm, one live replica's state per stage, then assembled.

Each stage is chosen and checked as a newcomer's download is (``download_for_newcomer``): the vouched
last-round state where two or more replicas agree, else one replica's current weights near the seeded
norms, said to be "not vouched". A stage with no replica, or none that delivers, fails the export, named.

    >>> sources = export_sources(await membership.all_replicas(), cfg.stages.num_stages)   # {stage: [StateClaim, ...]}
    >>> model, meta = await download_model(cfg, sources, fetch, on_progress=print)        # download each, assemble
    >>> save_checkpoint("model.pt", cfg, model, **meta)
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

from swarm.config import SwarmConfig
from swarm.dht.records import StageStatus
from swarm.errors import ExportError
from swarm.model.stages import assemble_model
from swarm.model.transformer import Transformer
from swarm.outer.claims import StateClaim, newcomer_claims, stage_claims
from swarm.outer.download import SizedFetch, download_for_newcomer
from swarm.outer.state import StageState
from swarm.rpc.blobs import TransferError


def export_sources(
    replicas: Mapping[int, Mapping[Any, StageStatus]], num_stages: int, *, have: Collection[int] = ()
) -> dict[int, list[StateClaim]]:
    """The claims to download each stage 0..S but those in ``have`` from, best first (``newcomer_claims``: only the
    vouched ones where a stage has any); ExportError names empty stages."""
    wanted = [stage for stage in range(num_stages + 1) if stage not in have]
    missing = [stage for stage in wanted if not replicas.get(stage)]
    if missing:
        names = ", ".join("0 (no trainer)" if stage == 0 else str(stage) for stage in missing)
        raise ExportError(
            f"stage {names} {'has' if len(missing) == 1 else 'have'} no live replica: wait until "
            f"{'it is' if len(missing) == 1 else 'they are'} served again (a lost middle stage is rebuilt by the swarm)"
        )
    return {
        stage: newcomer_claims(stage_claims({str(peer): status for peer, status in replicas[stage].items()}))
        for stage in wanted
    }


def claimed_blob(claim: StateClaim) -> str:
    """What an export takes from a claim's holders: the vouched global weights, else a replica's current weights
    (``state/<i>`` would be the last outer round's, up to H inner steps behind, and vouch for nothing more)."""
    return "state" if claim.vouched else "local"


async def download_model(
    cfg: SwarmConfig,
    sources: Mapping[int, list[StateClaim]],
    fetch: SizedFetch,
    *,
    have: Mapping[int, StageState] | None = None,
    on_progress: Callable[[str], None] = lambda line: None,
) -> tuple[Transformer, dict[str, Any]]:
    """Every stage's state from the first of its ``sources`` (claims, best first) that one of its holders fulfils
    (or from ``have``, e.g. a stopped trainer's saved stage 0), assembled; plus where each came from."""
    num_stages = cfg.stages.num_stages
    states: dict[int, StageState] = dict(have or {})
    origins = {
        stage: {"peer": "saved", "outer_round": s.round, "schedule_step": s.schedule_step}
        for stage, s in states.items()
    }
    for stage in sorted(set(range(num_stages + 1)) - set(states)):
        states[stage], origins[stage] = await _download_stage(cfg, stage, sources[stage], fetch, on_progress)
    model = assemble_model(cfg.model, num_stages, {stage: state.params for stage, state in states.items()})
    return model, {"exported_from": cfg.swarm_id, "stages": {str(stage): origin for stage, origin in origins.items()}}


async def _download_stage(
    cfg: SwarmConfig, stage: int, claims: list[StateClaim], fetch: SizedFetch, on_progress: Callable[[str], None]
) -> tuple[StageState, dict[str, Any]]:
    """Stage ``stage``'s state from the first of ``claims`` that one of its holders fulfils, and where it came from."""
    num_stages = cfg.stages.num_stages
    try:
        claim, peer, state = await download_for_newcomer(
            fetch, claims, model=cfg.model, num_stages=num_stages, stage=stage, blob_for=claimed_blob
        )
    except TransferError as e:
        raise ExportError(f"stage {stage}: {e}") from None
    vouched_by = len(claim.holders) if claim.vouched else 0  # 0: one replica's word, as a rebuild's sources count
    trust = f", vouched for by {vouched_by} replicas" if claim.vouched else ""
    on_progress(
        f"stage {stage}/{num_stages}: {sum(t.numel() for t in state.params.values()):,} parameters from {peer} "
        f"(outer round {state.round}, step {state.schedule_step}{trust})"
    )
    if claim.vouched and claim.round == 0:
        on_progress(f"stage {stage}: no outer round done yet: the vouched weights are the seeded ones")
    if not claim.vouched:
        why = "no outer step to vouch for" if not claim.weights_hash else "no two replicas announce the same weights"
        on_progress(f"stage {stage}: one replica's word, not vouched ({why})")
    origin = {"peer": peer, "outer_round": state.round, "schedule_step": state.schedule_step, "vouched_by": vouched_by}
    return state, origin
