"""Stage recovery in running swarms (CheckFree / CheckFree+), the claim that picks one rebuilder, and export.

The multi-process tests run real ``swarmloco run`` peers on loopback (tiny model, 3 middle stages,
short record TTLs so a dead peer vanishes within seconds), SIGKILL every replica of one stage and
read the peers' JSONL logs: the ``recovered`` event of the rebuilder, the ``state_served`` events of
the stages it read, and the ``recovery-*.pt`` file holding the merge inputs and result.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from swarm.config import PathConfig, SwarmConfig
from swarm.dht.records import RecoveryClaim, StageStatus
from swarm.events import Fault, Metrics, Move, Recovered, Serving
from swarm.export import ExportError, download_model, export_sources
from swarm.model.stages import build_stage
from swarm.node.config import PeerConfig
from swarm.outer.claims import StateClaim
from swarm.outer.state import StageState, pack_state, stream_state, unpack_state, weights_hash
from swarm.recovery.checkfree import checkfree_merge
from swarm.recovery.rebuild import (
    PRIORITY_JOINER,
    PRIORITY_MOVER,
    acquire_claim,
    claim_winner,
    empty_stages,
    rebuild_stage,
    swarm_has_trained,
)
from swarm.rpc.blobs import Sink, TransferError, feed
from swarmtest.configs import DATA, FAST_TIMEOUTS, tiny_config
from swarmtest.faults import kill_at
from swarmtest.processes import Swarm, swarmloco


def recovery_config(*, steps: int, paths: PathConfig | None = None) -> SwarmConfig:
    return tiny_config(
        stages=3, steps=steps, model={"n_layers": 3}, outer={"method": "none"}, paths=paths, timeouts=FAST_TIMEOUTS
    )


# ---- pure parts ----------------------------------------------------------------------------------------


def claim(priority: int) -> RecoveryClaim:
    return RecoveryClaim(priority=priority, claimed_at=1.0)


def test_the_claim_of_a_joining_peer_beats_a_mover_and_ties_go_to_the_smallest_peer_id() -> None:
    assert claim_winner({}) is None
    assert claim_winner({"QmB": claim(PRIORITY_MOVER), "QmC": claim(PRIORITY_JOINER)}) == "QmC"
    assert claim_winner({"QmB": claim(PRIORITY_MOVER), "QmA": claim(PRIORITY_MOVER)}) == "QmA"


def test_holes_and_whether_the_swarm_has_trained() -> None:
    trained, fresh = StageStatus(inner_steps=3), StageStatus()
    assert empty_stages({0: {"t": trained}, 1: {"a": trained}, 2: {}, 3: {}}, 3) == [2, 3]
    assert empty_stages({1: {"a": fresh}}, 2) == [2]
    assert swarm_has_trained({0: {"t": trained}, 1: {}}) and not swarm_has_trained({0: {"t": fresh}, 1: {"a": fresh}})
    assert swarm_has_trained({1: {"a": StageStatus(outer_round=1)}})


class FakeClaims:
    """The three claim calls of ``Membership`` over a shared dict, with another peer claiming as we settle."""

    def __init__(
        self, me: str, board: dict[str, RecoveryClaim], rival: tuple[str, RecoveryClaim] | None = None
    ) -> None:
        from hivemind.p2p import PeerID

        self.peer_id, self.board, self.rival, self._id = PeerID.from_base58(me), board, rival, PeerID.from_base58

    async def recovery_claims(self, stage: int) -> dict:
        return {self._id(peer): c for peer, c in self.board.items()}

    async def claim_recovery(self, stage: int, value: RecoveryClaim, *, expiration: float) -> None:
        self.board[self.peer_id.to_base58()] = value
        if self.rival:  # claimed at the same moment: visible only after ours
            self.board.setdefault(*self.rival)

    async def withdraw_recovery(self, stage: int) -> None:
        self.board.pop(self.peer_id.to_base58())


A, B = "QmXHXXz5S2uGQXx9Vws5WJAHRDCXqLXD8mLeQj1CnmG3S8", "QmTiZFEd9dxbRsrV4jt7Gj2dmfx8Xzj1k5B8PxTrkwKRSc"  # B < A


@pytest.mark.timeout(10)
def test_one_claimant_wins_and_nobody_claims_over_a_live_claim() -> None:
    run = lambda fake, priority: asyncio.run(acquire_claim(fake, 2, priority=priority, ttl_s=30, settle_s=0.01))
    assert run(FakeClaims(A, {}), PRIORITY_MOVER)  # alone
    board = {B: claim(PRIORITY_MOVER)}
    assert not run(FakeClaims(A, board), PRIORITY_JOINER) and A not in board  # B's claim is live: A does not even claim
    board = {}
    assert not run(FakeClaims(A, board, rival=(B, claim(PRIORITY_MOVER))), PRIORITY_MOVER) and set(board) == {
        B
    }  # tie: smaller id
    board = {}
    assert run(FakeClaims(A, board, rival=(B, claim(PRIORITY_MOVER))), PRIORITY_JOINER)  # a joiner beats a mover


def source_params(cfg: SwarmConfig, stage: int, scale: float) -> dict[str, torch.Tensor]:
    """The seeded weights of ``stage`` ×``scale``: a replica's, as far as norms tell, for a small ``scale``."""
    return {name: scale * p.detach() for name, p in build_stage(cfg.model, 3, stage).named_parameters()}


def source_blob(cfg: SwarmConfig, stage: int, scale: float, step: int, round_: int = 0) -> bytes:
    params = source_params(cfg, stage, scale)
    return pack_state(StageState(stage=stage, round=round_, schedule_step=step, params=params, optimizer=None))


@pytest.mark.timeout(20)
@pytest.mark.parametrize("swaps", [0, 1])
def test_rebuild_merges_interior_stages_and_copies_the_partner_of_an_edge_stage(swaps: int) -> None:
    cfg = recovery_config(steps=10, paths=PathConfig(max_swaps=swaps))
    blobs = {1: source_blob(cfg, 1, 1.0, 7), 2: source_blob(cfg, 2, 2.0, 9), 3: source_blob(cfg, 3, 4.0, 8)}
    norms = {1: 1.0, 2: 0.5, 3: 3.0}
    fetched = []

    async def replicas(stage: int) -> dict[str, StageStatus]:
        return {f"peer{stage}": StageStatus(grad_norm=norms[stage])}

    async def fetch(peer: str, name: str, sink: Sink, max_bytes: int) -> str:
        fetched.append(name)
        return await feed(blobs[int(name.split("/")[1])], sink)

    merged = asyncio.run(rebuild_stage(cfg, 2, replicas, fetch))
    assert merged.plan.kind == "merge" and fetched == ["local/1", "local/3"] and merged.state.schedule_step == 8
    template = dict(build_stage(cfg.model, 3, 1).named_parameters())
    w1, w3 = (unpack_state(blobs[s], stage=s, template=template).params for s in (1, 3))
    expected = checkfree_merge(w1, w3, 1.0, 3.0, num_blocks=1)
    assert all(torch.equal(merged.state.params[name], expected[name]) for name in expected)
    assert merged.event()["sources"][1]["sha256"] == hashlib.sha256(blobs[3]).hexdigest()[:16]

    edge = asyncio.run(rebuild_stage(cfg, 3, replicas, fetch))
    assert edge.plan.kind == ("copy-swap-partner" if swaps else "copy-neighbour") and edge.plan.sources == (2,)
    assert weights_hash(edge.state.params) == weights_hash(unpack_state(blobs[2], stage=2, template=template).params)


@pytest.mark.timeout(20)
def test_an_interior_stage_whose_neighbour_is_lost_too_copies_the_other_one() -> None:
    cfg = recovery_config(steps=10)

    async def replicas(stage: int) -> dict[str, StageStatus]:
        return {"peer1": StageStatus(grad_norm=1.0)} if stage == 1 else {}

    async def fetch(peer: str, name: str, sink: Sink, max_bytes: int) -> str:
        return await feed(source_blob(cfg, 1, 1.0, 3), sink)

    rebuilt = asyncio.run(rebuild_stage(cfg, 2, replicas, fetch))
    assert rebuilt.plan.kind == "copy-neighbour" and rebuilt.plan.sources == (1,)
    with pytest.raises(TransferError):
        asyncio.run(rebuild_stage(cfg, 2, lambda stage: replicas(0), fetch))


@pytest.mark.timeout(20)
def test_export_names_the_stages_without_a_replica_and_assembles_the_rest() -> None:
    with pytest.raises(ExportError, match=r"stage 0 \(no trainer\), 2 have no live replica"):
        export_sources({0: {}, 1: {"a": StageStatus()}, 2: {}}, 2)
    # no outer step: no weights hash, nothing vouched; the latest round first
    assert export_sources({0: {"t": StageStatus()}, 1: {"a": StageStatus(), "b": StageStatus(outer_round=2)}}, 1) == {
        0: [StateClaim(round=0, weights_hash="", holders=("t",))],
        1: [StateClaim(round=2, weights_hash="", holders=("b",)), StateClaim(round=0, weights_hash="", holders=("a",))],
    }

    cfg = recovery_config(steps=10)
    stages = {s: dict(build_stage(cfg.model, 3, s).named_parameters()) for s in range(4)}

    async def fetch(peer: str, name: str, sink: Sink, max_bytes: int) -> str:
        stage = int(name.split("/")[1])
        assert name == f"local/{stage}" and peer == f"p{stage}"
        params = {n: (1 + stage / 10) * p.detach() for n, p in stages[stage].items()}
        state = StageState(stage=stage, round=0, schedule_step=5, params=params, optimizer=None)
        return await feed(stream_state(state), sink)

    lines: list[str] = []
    sources = export_sources({s: {f"p{s}": StageStatus()} for s in range(4)}, 3)
    model, meta = asyncio.run(download_model(cfg, sources, fetch, on_progress=lines.append))
    assert meta["stages"]["2"] == {"peer": "p2", "outer_round": 0, "schedule_step": 5, "vouched_by": 0}
    state = model.state_dict()
    assert torch.equal(state["blocks.1.attn.qkv.weight"], 1.2 * stages[2]["blocks.0.attn.qkv.weight"].detach())
    assert torch.equal(state["embed.weight"], stages[0]["embed.weight"].detach())
    assert "stage 2: one replica's word, not vouched (no outer step to vouch for)" in lines


H = "a" * 16  # the honest replicas' weights hash in the records below (the fakes serve weights hashing to it)


def lying_swarm(cfg: SwarmConfig, stage: int, liar_scale: float) -> tuple[dict[str, StageStatus], Callable]:
    """Stage ``stage``'s records and a fetch: honest a and b at outer round 3 (their weights in both blobs), and "0liar"
    (first in any order by peer id) announcing their very claim while serving its weights ×``liar_scale``, and
    "9late" alone at a later round."""
    honest = source_params(cfg, stage, 1.1)
    vouched = weights_hash(honest)
    records = {peer: StageStatus(outer_round=3, global_hash=vouched, grad_norm=1.0) for peer in ("0liar", "a", "b")} | {
        "9late": StageStatus(outer_round=9, global_hash=H, grad_norm=1.0)
    }
    asked: list[tuple[str, str]] = []

    async def fetch(peer: str, name: str, sink: Sink, max_bytes: int) -> str:
        asked.append((peer, name))
        scale = {"0liar": liar_scale, "9late": liar_scale}.get(peer, 1.1)
        return await feed(source_blob(cfg, stage, scale, step=30, round_=3), sink)

    fetch.asked = asked  # type: ignore[attr-defined]  # the test reads whom it asked
    return records, fetch


@pytest.mark.timeout(20)
def test_an_export_takes_the_vouched_weights_and_never_a_holder_that_serves_others() -> None:
    cfg = recovery_config(steps=10)
    records, fetch = lying_swarm(cfg, 2, liar_scale=1000.0)
    honest = weights_hash(source_params(cfg, 2, 1.1))
    have = {
        s: StageState(stage=s, round=0, schedule_step=0, params=source_params(cfg, s, 1.0), optimizer=None)
        for s in (0, 1, 3)
    }
    lines: list[str] = []
    sources = export_sources({2: records}, 3, have=have)
    assert [(c.round, c.holders) for c in sources[2]] == [(3, ("0liar", "a", "b"))]  # the lone later claim is no source
    model, meta = asyncio.run(download_model(cfg, sources, fetch, have=have, on_progress=lines.append))
    # the liar was asked first (smallest id), served other weights and was refused; a's are the claimed ones
    assert fetch.asked == [("0liar", "state/2"), ("a", "state/2")]
    assert meta["stages"]["2"]["peer"] == "a" and meta["stages"]["2"]["vouched_by"] == 3
    assert any("vouched for by 3 replicas" in line for line in lines)
    exported = {name: model.state_dict()[name.replace("blocks.0", "blocks.1")] for name in source_params(cfg, 2, 1.0)}
    assert weights_hash(exported) == honest

    # only liars hold the vouched claim: the export fails, naming what each served, rather than take one's word
    liars_only = {peer: StageStatus(outer_round=3, global_hash=honest) for peer in ("0liar", "1liar")}
    sources = export_sources({2: liars_only}, 3, have=have)

    async def lies(peer: str, name: str, sink: Sink, max_bytes: int) -> str:
        return await feed(source_blob(cfg, 2, 1000.0, step=30, round_=3), sink)

    with pytest.raises(ExportError, match=rf"stage 2: .*0liar: served weights hashing to .*its record claims {honest}"):
        asyncio.run(download_model(cfg, sources, lies, have=have))


@pytest.mark.timeout(20)
def test_a_rebuild_takes_the_vouched_round_state_and_never_a_holder_that_serves_others() -> None:
    cfg = recovery_config(steps=10)
    records, fetch = lying_swarm(cfg, 2, liar_scale=1000.0)
    rebuilt = asyncio.run(rebuild_stage(cfg, 3, lambda stage: asyncio.sleep(0, records), fetch))  # a copy of stage 2
    (source,) = rebuilt.sources
    assert fetch.asked == [("0liar", "state/2"), ("a", "state/2")]
    assert (source.peer, source.vouched_by) == ("a", 3)
    assert weights_hash(rebuilt.state.params) == weights_hash(source_params(cfg, 2, 1.1))


@pytest.mark.timeout(20)
def test_with_nothing_vouched_a_rebuild_takes_current_weights_only_where_other_replicas_bear_them_out() -> None:
    cfg = recovery_config(steps=10)

    def rebuild(scales: dict[str, float]) -> tuple[str, list[str]]:
        """Rebuild stage 3 from stage 2's replicas serving the seeded weights × their scale; (source peer, asked)."""
        records = {peer: StageStatus(grad_norm=1.0) for peer in scales}  # no outer step: no claim to vouch
        asked: list[str] = []

        async def fetch(peer: str, name: str, sink: Sink, max_bytes: int) -> str:
            assert name == "local/2"
            asked.append(peer)
            return await feed(source_blob(cfg, 2, scales[peer], step=30), sink)

        (source,) = asyncio.run(rebuild_stage(cfg, 3, lambda stage: asyncio.sleep(0, records), fetch)).sources
        assert source.vouched_by == 0
        return source.peer, asked

    assert rebuild({"a": 1.1}) == ("a", ["a"])  # a lone replica: its word, near the seeded norms
    assert rebuild({"a": 1.1, "b": 1.3}) == ("a", ["a", "b"])  # b bears a out
    # far from the seeded norms: refused outright, and no reference for the honest one
    assert rebuild({"0liar": 1000.0, "a": 1.1}) == ("a", ["0liar", "a"])
    # near the seeded norms but ×30 the others': refused against a and b, while they bear each other out
    assert rebuild({"0liar": 30.0, "a": 1.1, "b": 1.2}) == ("a", ["0liar", "a", "b"])
    # a pair that disagrees beyond ×10: either may be the liar, so neither is taken
    with pytest.raises(TransferError, match="0liar: its weights differ from every other replica's.*a: its weights"):
        rebuild({"0liar": 30.0, "a": 1.1})


def test_a_stage_checkpoint_needs_its_file_and_loads_back_checked(tmp_path: Path) -> None:
    from swarm.node.config import PeerConfig
    from swarm.recovery.rebuild import load_stage_checkpoint

    with pytest.raises(ValueError, match="stage_checkpoint") as error:
        PeerConfig(role="stage", stage=2, checkpoint_every=10)
    assert error.value.field == "checkpoint_every"
    cfg = recovery_config(steps=10)
    path = tmp_path / "stage2.ckpt"
    path.write_bytes(source_blob(cfg, 2, 0.5, 40))
    state = load_stage_checkpoint(path, cfg, 2)
    assert state.schedule_step == 40 and state.stage == 2
    with pytest.raises(ValueError, match="stage 2, expected 3"):
        load_stage_checkpoint(path, cfg, 3)


# ---- real swarms ---------------------------------------------------------------------------------------


def check_rebuild(swarm: Swarm, rebuilder: str, stage: int, sources: dict[int, str]) -> Recovered:
    """The rebuilder's ``recovered`` event matches the formula applied to the blobs its sources served; returns the event."""
    # the event comes once the rebuilt stage is installed, just after the move (or start) that led to it is logged
    (event,) = swarm.wait(f"{rebuilder}'s recovered event", lambda: swarm.records(rebuilder, Recovered), 30)
    assert event.stage == stage and event.lr_scale == pytest.approx(1.1) and event.saved is not None
    saved = torch.load(event.saved, weights_only=False)
    inputs = {}
    for source in saved["sources"]:
        sha = hashlib.sha256(source["blob"]).hexdigest()[:16]
        assert sha in swarm.served(sources[source["stage"]]), (
            source["stage"],
            sha,
        )  # exactly what that neighbour served
        template = dict(build_stage(swarm.cfg.model, 3, source["stage"]).named_parameters())
        inputs[source["stage"]] = (
            unpack_state(source["blob"], stage=source["stage"], template=template).params,
            source["grad_norm"],
        )
    assert sorted(inputs) == sorted(sources)
    if len(inputs) == 2:
        (prev, g_prev), (next_, g_next) = inputs[stage - 1], inputs[stage + 1]
        assert g_prev > 0 and g_next > 0  # the neighbours' last gradient norms, from their records
        expected = checkfree_merge(prev, next_, g_prev, g_next, num_blocks=1)
    else:
        ((expected, _),) = inputs.values()
    assert all(torch.equal(saved["params"][name], expected[name]) for name in expected)
    assert event.weights_hash == event.installed_hash == weights_hash(saved["params"])  # and served exactly that
    return event


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_killed_interior_stage_is_rebuilt_by_the_rebalancer_and_the_running_swarm_exports(
    tmp_path: Path, child_processes: list
) -> None:
    steps = 5000  # trains on while the test looks (it must not finish first, however fast it runs); stopped at the end
    swarm = Swarm(tmp_path, recovery_config(steps=steps), child_processes)
    faults = kill_at({"stage2-a": 10})  # every peer gets it; stage2-a SIGKILLs itself at its inner step 10
    swarm.gone.add("stage2-a")
    for name, stage in (("stage3-a", 3), ("stage2-a", 2)):
        swarm.spawn(name, PeerConfig(role="stage", stage=stage, faults=faults))
    swarm.wait(
        "stage 2 to serve", lambda: swarm.records("stage2-a", Serving), 90
    )  # else stage 1's movers would fill it
    pair = [
        "stage1-a",
        "stage1-b",
    ]  # stage 1 has a replica to spare: the less loaded one moves (600 s: no throughput moves)
    for name in pair:
        swarm.spawn(name, PeerConfig(role="stage", stage=1, rebalance_period_s=600.0, faults=faults))
    swarm.spawn("trainer-0", PeerConfig(role="trainer", steps=steps, data=[DATA]))

    (fault,) = swarm.wait("stage2-a to die at its step 10", lambda: swarm.records("stage2-a", Fault), 120)
    assert fault.step >= 10 and fault.stage == 2 and fault.action == "kill", fault
    swarm.wait("stage2-a's process to be gone", lambda: swarm.procs["stage2-a"].poll() is not None, 10)
    killed_at = fault.time
    ((mover, move),) = swarm.wait(
        "a stage-1 server to move", lambda: [(n, r) for n in pair for r in swarm.records(n, Move)], 60
    )
    assert move.from_stage == 1 and move.to_stage == 2 and move.rebuilt, move
    stayer = next(n for n in pair if n != mover)  # a merge source: stage 1 kept a replica
    event = check_rebuild(swarm, mover, 2, {1: stayer, 3: "stage3-a"})
    assert event.kind == "merge" and event.time - killed_at < 30
    served = swarm.wait(
        "a microbatch through the rebuilt stage",
        lambda: [r for r in swarm.records(mover) if r.get("stage") == 2 and r.get("backward", 0) > 0],
        60,
    )
    assert served[0]["first_served_at"] - killed_at < 30

    out = tmp_path / "model.pt"  # export the running swarm (the rebuilt stage included) and evaluate it
    (export,) = swarmloco(
        ["export", *swarm.join, "--config", str(tmp_path / "swarm.toml"), "-o", str(out)],
        children=child_processes,
        timeout=120,
    )
    assert export.returncode == 0 and out.exists(), export.stdout + export.stderr
    assert "stage 2/3" in export.stdout and "wrote" in export.stdout
    (evaluated,) = swarmloco(
        ["eval", "--checkpoint", str(out), "--data", DATA, "--json"], children=child_processes, timeout=120
    )
    assert evaluated.returncode == 0, evaluated.stderr
    val_loss = json.loads(evaluated.stdout.splitlines()[-1])["val_loss"]
    assert val_loss < 5.0  # trained: a byte-level model starts near ln(256) ≈ 5.5

    step_at_export = swarm.progress("trainer-0")[-1]["step"]
    swarm.wait("10 more steps", lambda: swarm.progress("trainer-0")[-1]["step"] >= step_at_export + 10, 60)
    swarm.stop("trainer-0", *pair, "stage3-a")
    last = swarm.progress("trainer-0")[-1]
    assert last["skipped_hops"] > 0 and last["failed"] <= 3, last  # stage 2 was skipped, not fatal
    published = [r.metrics for r in swarm.records(mover, Metrics) if r.metrics["stage"] == 2]
    assert published and published[-1]["recoveries"] == 1
    assert not swarm.records(stayer, Move) and not swarm.records(stayer, Recovered)  # exactly one rebuilder


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_killed_edge_stage_with_swaps_is_rebuilt_by_a_joining_peer_as_a_copy_of_its_partner(
    tmp_path: Path, child_processes: list
) -> None:
    steps = 400
    swarm = Swarm(tmp_path, recovery_config(steps=steps, paths=PathConfig(max_swaps=1, swap_prob=0.5)), child_processes)
    for stage in (1, 2, 3):
        swarm.spawn(f"stage{stage}-a", PeerConfig(role="stage", stage=stage))
    swarm.spawn("trainer-0", PeerConfig(role="trainer", steps=steps, data=[DATA]))
    swarm.wait("10 steps", lambda: any(r["step"] >= 10 for r in swarm.progress("trainer-0")), 120)

    killed_at = swarm.kill("stage3-a")
    swarm.wait("the trainer to skip stage 3", lambda: swarm.progress("trainer-0")[-1]["skipped_hops"] > 0, 60)
    with swarm.observer() as membership:  # --role auto takes an empty stage: one whose dead peer's record has expired
        swarm.wait(
            "the dead peer's record to expire",
            lambda: not asyncio.run(membership.replicas(3)),
            2 * FAST_TIMEOUTS.record_ttl_s + 30,
        )
    swarm.spawn("joiner", PeerConfig(role="auto"))  # --role auto: the empty stage first
    event = swarm.wait("the joiner to rebuild stage 3", lambda: swarm.records("joiner", Recovered), 90)[0]
    event = check_rebuild(swarm, "joiner", 3, {2: "stage2-a"})
    assert event.kind == "copy-swap-partner"
    swarm.wait(
        "a microbatch through the rebuilt stage",
        lambda: [r for r in swarm.records("joiner") if r.get("backward", 0) > 0],
        60,
    )
    swarm.stop("trainer-0", "stage1-a", "stage2-a", "joiner")
    last = swarm.progress("trainer-0")[-1]
    assert last["failed"] <= 3, last
    assert event.time - killed_at < 90
