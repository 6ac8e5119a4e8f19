"""Export: the whole model out of a running swarm, assembled from one live replica of every stage.

Every middle stage's weights come from one of its servers and stage 0 (embedding, final norm, LM
head) from a trainer: the replica's current (local) weights, served as ``local/<i>`` blobs in the
state archive format (hash-checked, checked against the stage's shapes). ``assemble_model`` glues
them into the plain ``Transformer`` that ``swarm/recovery/checkpoint.py`` saves and ``swarmloco eval`` /
``sample`` load. A stage with no live replica makes the export fail, naming it, rather than fill
it with untrained weights.

    >>> sources = export_sources(await membership.all_replicas(), cfg.stages.num_stages)   # {stage: [peer, ...]}
    >>> model, meta = await download_model(cfg, sources, fetch, on_progress=print)
    >>> save_checkpoint("model.pt", cfg, model, **meta)
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection, Mapping
from typing import Any

from swarm.config import SwarmConfig
from swarm.dht.records import StageStatus
from swarm.errors import ExportError
from swarm.model.stages import assemble_model, stage_template
from swarm.model.transformer import Transformer
from swarm.outer.transfer import StageState, download_state, state_bytes_bound
from swarm.rpc.blobs import Sink, TransferError

# (peer, blob name, sink, max bytes) → the blob's SHA-256 once it has streamed into the sink whole, or TransferError
SizedFetch = Callable[[str, str, Sink, int], Awaitable[str]]


def export_sources(
    replicas: Mapping[int, Mapping[Any, StageStatus]], num_stages: int, *, have: Collection[int] = ()
) -> dict[int, list[str]]:
    """Peers to download each stage 0..S but those in ``have`` from, the most advanced (latest outer round) first;
    ExportError names empty stages."""
    wanted = [stage for stage in range(num_stages + 1) if stage not in have]
    missing = [stage for stage in wanted if not replicas.get(stage)]
    if missing:
        names = ", ".join("0 (no trainer)" if stage == 0 else str(stage) for stage in missing)
        raise ExportError(
            f"stage {names} {'has' if len(missing) == 1 else 'have'} no live replica: wait until "
            f"{'it is' if len(missing) == 1 else 'they are'} served again (a lost middle stage is rebuilt by the swarm)"
        )
    return {
        stage: [str(peer) for peer in sorted(replicas[stage], key=lambda p: (-replicas[stage][p].outer_round, str(p)))]
        for stage in wanted
    }


async def download_model(
    cfg: SwarmConfig,
    sources: Mapping[int, list[str]],
    fetch: SizedFetch,
    *,
    have: Mapping[int, StageState] | None = None,
    on_progress: Callable[[str], None] = lambda line: None,
) -> tuple[Transformer, dict[str, Any]]:
    """Every stage's state from the first of its ``sources`` that delivers (or from ``have``, e.g. a stopped
    trainer's saved stage 0), assembled; plus where each came from."""
    num_stages, states, meta = cfg.stages.num_stages, {}, {"exported_from": cfg.swarm_id, "stages": {}}
    for stage, state in (have or {}).items():
        states[stage] = state.params
        meta["stages"][str(stage)] = {"peer": "saved", "outer_round": state.round, "schedule_step": state.schedule_step}
    for stage in sorted(set(range(num_stages + 1)) - set(states)):
        template = stage_template(cfg.model, num_stages, stage)
        try:
            bound = state_bytes_bound(template)
            # local/<i>: a replica's current weights (state/<i> would be the last outer round's, up to H steps behind)
            peer, state = await download_state(
                lambda peer, name, sink: fetch(peer, name, sink, bound),
                sources[stage],
                stage=stage,
                template=template,
                blob="local",
            )
        except TransferError as e:
            raise ExportError(f"stage {stage}: {e}") from None
        states[stage] = state.params
        meta["stages"][str(stage)] = {"peer": peer, "outer_round": state.round, "schedule_step": state.schedule_step}
        on_progress(
            f"stage {stage}/{num_stages}: {sum(t.numel() for t in state.params.values()):,} parameters from {peer} "
            f"(outer round {state.round}, step {state.schedule_step})"
        )
    return assemble_model(cfg.model, num_stages, states), meta
