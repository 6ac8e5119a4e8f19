"""Export: the whole model out of a running swarm, assembled from one live replica of every stage.

Every middle stage's weights come from one of its servers and stage 0 (embedding, final norm, LM
head) from a trainer, chosen and checked as a newcomer's download is (``swarm/outer/transfer.py``):
no single peer's word decides what is exported where the swarm vouches for more.

- **Vouched.** Where two or more replicas of a stage announce the same outer round and weights
  hash, only such claims are tried (the latest round first) and the weights are the last outer
  round's global weights (``state/<i>``), which must hash to the claim: a replica that announces
  the vouched hash but serves other weights is refused and the next holder asked.
- **One replica's word.** A stage with no vouched claim (a lone replica, a pair split by a failed
  round, or no outer step at all: no weights hash) gives a replica's current weights (``local/<i>``),
  the latest round's first, refused if their norms are far from the seeded ones
  (``NEWCOMER_MAX_NORM_RATIO``); the progress line says the stage is not vouched for.

Each stage arrives as a state archive stream (hash-checked, checked against the stage's shapes).
``assemble_model`` glues them into the plain ``Transformer`` that ``swarm/recovery/checkpoint.py`` saves
and ``swarmloco eval`` / ``sample`` load. A stage with no live replica makes the export fail, naming
it, rather than fill it with untrained weights; so does a stage none of whose claimants delivers.

    >>> sources = export_sources(await membership.all_replicas(), cfg.stages.num_stages)   # {stage: [StateClaim, ...]}
    >>> model, meta = await download_model(cfg, sources, fetch, on_progress=print)
    >>> save_checkpoint("model.pt", cfg, model, **meta)
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection, Mapping
from typing import Any

from swarm.config import SwarmConfig
from swarm.dht.records import StageStatus
from swarm.errors import ExportError
from swarm.model.stages import assemble_model, seeded_norms, stage_shapes
from swarm.model.transformer import Transformer
from swarm.outer.transfer import (
    StageState,
    StateClaim,
    download_claimed,
    newcomer_acceptance,
    newcomer_claims,
    stage_claims,
    state_bytes_bound,
)
from swarm.rpc.blobs import Sink, TransferError

# (peer, blob name, sink, max bytes) → the blob's SHA-256 once it has streamed into the sink whole, or TransferError
SizedFetch = Callable[[str, str, Sink, int], Awaitable[str]]


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
    num_stages, states, meta = cfg.stages.num_stages, {}, {"exported_from": cfg.swarm_id, "stages": {}}
    for stage, state in (have or {}).items():
        states[stage] = state.params
        meta["stages"][str(stage)] = {"peer": "saved", "outer_round": state.round, "schedule_step": state.schedule_step}
    for stage in sorted(set(range(num_stages + 1)) - set(states)):
        template = stage_shapes(cfg.model, num_stages, stage)  # names and shapes; a lone claim meets seeded_norms
        bound = state_bytes_bound(template)
        try:
            claim, peer, state = await download_claimed(
                lambda peer, name, sink: fetch(peer, name, sink, bound),
                sources[stage],
                stage=stage,
                template=template,
                check_for=newcomer_acceptance(seeded_norms(cfg.model, num_stages, stage)),
                blob_for=claimed_blob,
            )
        except TransferError as e:
            raise ExportError(f"stage {stage}: {e}") from None
        states[stage] = state.params
        vouched_by = len(claim.holders) if claim.vouched else 0  # 0: one replica's word, as a rebuild's sources count
        meta["stages"][str(stage)] = {
            "peer": peer,
            "outer_round": state.round,
            "schedule_step": state.schedule_step,
            "vouched_by": vouched_by,
        }
        trust = f", vouched for by {vouched_by} replicas" if claim.vouched else ""
        on_progress(
            f"stage {stage}/{num_stages}: {sum(t.numel() for t in state.params.values()):,} parameters from {peer} "
            f"(outer round {state.round}, step {state.schedule_step}{trust})"
        )
        if claim.vouched and claim.round == 0:
            on_progress(f"stage {stage}: no outer round done yet: the vouched weights are the seeded ones")
        if not claim.vouched:
            why = (
                "no outer step to vouch for" if not claim.weights_hash else "no two replicas announce the same weights"
            )
            on_progress(f"stage {stage}: one replica's word, not vouched ({why})")
    return assemble_model(cfg.model, num_stages, states), meta
