"""Every attack of issue 20 against a small swarm, next to a clean run of the same swarm: does the honest side hold?

The attacks are the ones the tests reproduce (tests/test_stage_poisoning.py, test_outer_attacks.py,
test_membership.py, test_outer.py), played here with the same helpers (swarmtest.attacks, .loopback, .node):

- stage-nan, cache-flood, forged-records, grad-570x-sybil: a real stage server and a real trainer (tiny model,
  in-process ``BackgroundNode``s on loopback) train ``--steps`` inner steps on Python's email sources while the attacker
  poisons backward gradients (an int8 scale of 3.4e38, refused at the wire, or ×10⁴), sends gradients ~570× the
  median from 7 fresh identities in turn (65 a minute), floods forwards, or forges stage records; the honest outcome is the
  trainer's validation loss against the clean run's.
- state-liar, round-staller, pg-x1000: honest replicas of stage 1 (``LoopbackReplica``: real membership, outer
  service and rounds, H = 3; each trains its own stage 0 and stage 1 on its own text, ``TrainingHolder``)
  take ``--steps`` inner steps with two colluding identities announcing round 10⁶ and serving garbage weights (the
  seeded norms) from mid-run, two identities declaring every round long opened (60 s, or the oldest time a round
  can have) with no payload, or a peer sending a ×1000 pseudo-gradient as the only other member of the round. The
  honest outcome is the honest replicas' mean validation loss against the clean run's, and the outer rounds they
  completed; ``banned``: every attacker identity banned (yes) or only struck by every honest replica.
- pg-flip9, pg-flip1, pg-flip9-two, pg-flip9-pair, pg-orthogonal-pair (issue 42's adaptive attackers, under the
  ×10 norm screen): as pg-x1000, with 3 replicas and one sending −9× or −1× its Δ, 5 replicas and two sending the
  same −9× flip, or a pair whose other member sends −9× its Δ or 9× its Δ rolled by one coordinate (at right angles).
- stage-garbler, stage-silent: three stage-1 servers and a trainer (``BackgroundNode``s, outer off, rpc_s 30 s); one
  server (one identity) answers every forward with random activations of the true per-token norm, or takes every
  call and never answers. The honest outcome is the trainer's val loss and tokens/s against the clean run's (three
  honest servers); ``--check-rate`` sets the trainer's share of forwards checked (0: checking off).
- stage-lazy, stage-collude (issue 42): as stage-garbler, with a server passing its input through (forward and
  backward: it computes nothing), or two of the three returning the same wrong output for the same input (random
  activations of the input's norm, seeded by the input: they agree exactly when they check each other).
- stage-gradflip: one server of stage 1, three of stage 2 and a trainer; one stage-2 server computes honestly but
  returns its input gradients sign-flipped (its forwards pass every check).
- stage-noise, stage-gradnoise (just under a threshold): as stage-garbler, a server adding noise of 0.2 × each
  token's norm to its true outputs (under the 0.25 within which two outputs agree outright); as stage-gradflip, a
  stage-2 server adding noise at right angles to its input gradients, as much as a backward probe passes (descent
  0.35 against the 0.25 that fails).
- stage-late-join (no attacker: false verdicts): three honest stage-1 servers in DiLoCo rounds (H = 10); the first
  trains alone with the trainer for a quarter of the run before the other two join. Every stage scenario counts what
  befell the honest servers: condemned (a published verdict), found unfit (routed around by the trainer until they
  sync), banned for deadlines, struck in the outer rounds.
- state-drain (issue 42): one identity downloads a stage's state again and again from a holder that also serves its
  stage's two other replicas and a joiner, at real size (a 125m middle stage of 3: 226 MB states, 113 MB payloads, a
  12.5 MB/s uplink, 600 s), in ``scripts/bench_drain.py``'s model of the holder's uplink over the real
  ``BlobServicer``. The honest outcome is the joiner's download time; ``drainer_share_of_upload`` is the drainer's
  share of the holder's upload (its fair share: 25%); ``--undefended``: the count budget alone, no byte bound.
- memory-bomb: a real ``OuterOptimizer`` applies a round with a SparseLoCo frame declaring (1, 64M) and a DiLoCo
  fp32 frame declaring (4096, 4096); tracemalloc's peak against the same round without the bomb.

Each run is a fresh process of this script, so each peak RSS (VmHWM) is that run's own.

    python3 scripts/bench_adversary.py                                  # every attack, table on stdout
    python3 scripts/bench_adversary.py --only stage-nan pg-x1000 --json /tmp/adv.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import subprocess
import sys
import threading
import time
import tracemalloc
from collections.abc import Iterable
from pathlib import Path
from typing import Any

ATTACKS = (
    "stage-nan",
    "state-liar",
    "round-staller",
    "pg-x1000",
    "forged-records",
    "memory-bomb",
    "cache-flood",
    "stage-garbler",
    "stage-silent",
    "grad-570x-sybil",
    "pg-flip9",
    "pg-flip1",
    "pg-flip9-two",
    "pg-flip9-pair",
    "pg-orthogonal-pair",
    "stage-gradflip",
    "stage-lazy",
    "stage-collude",
    "stage-late-join",
    "stage-noise",
    "stage-gradnoise",
    "state-drain",
)
# the rest: outer attacks, and the in-process memory bomb
PIPELINE = {"stage-nan", "cache-flood", "forged-records", "grad-570x-sybil"}
# three stage-1 servers, one the attacker's (two for stage-collude), and a trainer
STAGES = {"stage-garbler", "stage-silent", "stage-lazy", "stage-collude", "stage-noise"}
STAGES2 = {"stage-gradflip", "stage-gradnoise"}  # one stage-1 server, three of stage 2 (one the attacker's), a trainer
# no attacker (issue 42's false verdicts): three honest stage-1 servers in outer rounds (DiLoCo, H = LATE_JOIN_H), the
# first training alone with the trainer until it is LATE_JOIN_AT of the way through, the other two joining then from
# the seeded weights or a download; its clean run has all three from the start
STAGES_OUTER = {"stage-late-join"}
LATE_JOIN_H, LATE_JOIN_AT = 10, 0.25
OUTER = {"state-liar", "round-staller", "pg-x1000", "pg-flip9-pair", "pg-orthogonal-pair"}
# Adaptive pseudo-gradient attackers (issue 42), each under the ×10 norm screen, among replicas of stage 1. The last
# letter of the Δ a peer sends: θ_global − (θ_global − scale × Δ) ... see ``ADAPTIVE_PG``.
OUTER3 = {"pg-flip9", "pg-flip1"}  # 3 replicas, 1 attacker (f < K/2: the centred clip's bound holds)
OUTER5 = {"pg-flip9-two"}  # 5 replicas, 2 colluding attackers sending the same flip
DRAIN = {"state-drain"}  # one holder's uplink at real size (scripts/bench_drain.py), a drainer among honest peers
# the attacker's Δ as a function of its own honest Δ: −9× and −1× (flips under the ×10 norm screen), or 9× its own Δ
# rolled by one coordinate (at right angles to it, as large as the screen lets through)
ADAPTIVE_PG = {
    "pg-flip9": -9.0,
    "pg-flip1": -1.0,
    "pg-flip9-two": -9.0,
    "pg-flip9-pair": -9.0,
    "pg-orthogonal-pair": "roll9",
}


def peak_rss_mb() -> float:
    """This process's peak resident set (VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return math.nan


# ---- stage-nan, cache-flood, forged-records: a stage server and a trainer ---------------------------------------


def pipeline_run(attack: str | None, steps: int, seed: int) -> dict[str, Any]:
    import torch
    from hivemind.p2p import P2P, PeerID

    from peer.data import load_corpus
    from swarm.dht.membership import stage_key
    from swarm.node.config import PeerConfig
    from swarm.pipeline.protocol import Forward, RemoteError, RequestError, StageClient
    from swarmtest.attacks import INT8, activations, forge_replicas, microbatch, modified_peer, poisoned, stored_subkeys
    from swarmtest.configs import DATA, FAST_TIMEOUTS, LOOPBACK_MADDRS, tiny_config
    from swarmtest.node import BackgroundNode

    torch.set_num_threads(1)
    cfg = tiny_config(stages=1, steps=steps, outer={"method": "none"}, timeouts=FAST_TIMEOUTS)

    def data(cfg: Any, peer_id: str) -> Any:
        corpus = load_corpus([DATA])
        kw = dict(batch_size=cfg.train.microbatch_size, seq_len=cfg.train.seq_len)
        return corpus.sample_batches("train", seed=1 + seed, **kw), corpus.val_batches(num_sequences=64, **kw)

    outcome: dict[str, Any] = {"banned": "n.a."}
    stop = threading.Event()

    def attacker(server_maddrs: list[str], server: PeerID) -> None:
        async def play() -> None:
            p2p = await P2P.create(initial_peers=server_maddrs, host_maddrs=LOOPBACK_MADDRS)
            client = StageClient(p2p, namespace=cfg.swarm_id)
            refused = sent = at_the_wire = 0
            try:
                while not stop.is_set():
                    sent += 1
                    try:
                        if attack == "stage-nan":
                            await microbatch(client, server, cfg, f"evil{sent}", grad=poisoned(cfg, sent))
                        else:  # cache-flood: forwards never followed by a backward
                            x = INT8.encode(activations(cfg))
                            await client.forward(server, Forward(mb=f"f{sent}", stage=1, prev_stage=0, x=x), timeout=10)
                    except RemoteError as e:
                        refused += 1
                        at_the_wire += "over the receiver's limit" in e.message  # the 3.4e38 scale (BOUNDARY_MAX_ABS)
                        if e.code == RequestError.BANNED:
                            outcome["banned"] = "yes"
                            break
                    await asyncio.sleep(0.05 if attack == "stage-nan" else 0.02)
            finally:
                outcome.update(attacker_requests=sent, attacker_refused=refused, refused_at_the_wire=at_the_wire)
                await p2p.shutdown()

        asyncio.run(play())

    stage = PeerConfig(role="stage", stage=1, name="stage1-a", host_maddrs=LOOPBACK_MADDRS)
    with BackgroundNode(stage, cfg) as server_node:
        server = server_node.call(lambda node: asyncio.sleep(0, node.dht.peer_id))
        forger = None
        if attack == "forged-records":
            forger, signer = modified_peer(server_node.maddrs)
            key = stage_key(cfg.swarm_id, 1)
            forged = asyncio.run(forge_replicas(forger, signer, key, server))
            accepted = forged & server_node.call(lambda n: stored_subkeys(n.dht, key))
            outcome["banned"] = "no" if accepted else "yes"  # refused: no forged record accepted
        thread = None
        if attack in ("stage-nan", "cache-flood"):
            outcome["banned"] = "no"
            thread = threading.Thread(target=attacker, args=(server_node.maddrs, server), daemon=True)
        elif attack == "grad-570x-sybil":
            outcome["banned"] = "no"
            holder = server_node.call(lambda node: asyncio.sleep(0, node.role.holder))
            thread = threading.Thread(
                target=play_sybils, args=(cfg, holder, server_node.maddrs, server, stop, outcome), daemon=True
            )
        trainer = PeerConfig(
            role="trainer", name="trainer", initial_peers=server_node.maddrs, host_maddrs=LOOPBACK_MADDRS, steps=steps
        )
        try:
            with BackgroundNode(trainer, data=data) as peer:
                if thread is not None:
                    peer.wait("the first progress", lambda: peer.records, 120)  # the screen's warm-up is honest
                    thread.start()
                last = peer.result(timeout=300)
        finally:
            stop.set()
            if thread is not None:
                thread.join(30)
            if forger is not None:
                forger.shutdown()
    if attack == "forged-records" and last["hop_failures"]:
        outcome["banned"] = "no"
    return {
        **outcome,
        "metric": "val_loss",
        "value": last.get("val_loss"),
        "step": last["step"],
        "failed": last["failed"],
        "hop_failures": last["hop_failures"],
        "rounds": None,
    }


SYBILS, SYBIL_RATIO, SYBIL_EVERY_S = 7, 570.0, 60 / 65  # the issue's attack: 7 identities, ~570× the median, 65/min


def play_sybils(
    cfg: Any, holder: Any, maddrs: list[str], server: Any, stop: threading.Event, outcome: dict[str, Any]
) -> None:
    """grad-570x-sybil: backward gradients at ~SYBIL_RATIO× the stage's median norm from SYBILS fresh identities in
    turn, steered by the norms the server's screen measured (a spy on ``judge``: the attacker's best case)."""
    import torch
    from hivemind.p2p import P2P

    from swarm.pipeline.protocol import RemoteError, RequestError, StageClient
    from swarmtest.attacks import HONEST_SCALE, INT8, microbatch
    from swarmtest.configs import BATCH, LOOPBACK_MADDRS, SEQ

    judged: list[tuple[Any, float, float, Any]] = []  # (peer, norm, the median it was judged by, verdict)
    judge = holder.screen.judge

    def spy(norm: float, peer: Any) -> Any:
        median, verdict = holder.screen.bounds()[0], judge(norm, peer)
        judged.append((peer, norm, median, verdict))
        return verdict

    holder.screen.judge = spy

    async def play() -> None:
        p2ps = await asyncio.gather(
            *(P2P.create(initial_peers=maddrs, host_maddrs=LOOPBACK_MADDRS) for _ in range(SYBILS))
        )
        ids, clients = {p.peer_id for p in p2ps}, [StageClient(p, namespace=cfg.swarm_id) for p in p2ps]
        scale, sent = SYBIL_RATIO, 0
        try:
            while not stop.is_set():
                grad = INT8.encode(torch.randn(BATCH, SEQ, cfg.model.d_model) * HONEST_SCALE * scale)
                try:
                    await microbatch(clients[sent % SYBILS], server, cfg, f"sybil{sent}", grad=grad)
                except RemoteError as e:
                    outcome["banned"] = "yes" if e.code == RequestError.BANNED else outcome["banned"]
                sent += 1
                mine = [(norm, median) for peer, norm, median, _ in judged if peer in ids and median > 0]
                if mine:  # the norm is linear in the gradient's scale
                    scale *= SYBIL_RATIO * mine[-1][1] / mine[-1][0]
                await asyncio.sleep(SYBIL_EVERY_S)
        finally:
            outcome.update(identities=SYBILS, attacker_requests=sent, attacker=screened(judged, ids))
            for p2p in p2ps:
                await p2p.shutdown()

    asyncio.run(play())


def screened(judged: list[tuple[Any, float, float, Any]], attackers: set[Any]) -> dict[str, Any]:
    """What the stage's screen made of the attackers' and the honest trainer's microbatches."""
    summary: dict[str, Any] = {}
    for side in ("attacker", "honest"):
        mine = [(n / m, v) for p, n, m, v in judged if (p in attackers) == (side == "attacker") and m > 0]
        kept = [(r, v) for r, v in mine if v.refusal is None]
        summary[side] = {
            "judged": len(mine),
            "refused": len(mine) - len(kept),
            "clipped": sum(v.clipped for _, v in kept),
            "on_probation": sum(v.probation for _, v in kept),
            "median_ratio": sorted(r for r, _ in mine)[len(mine) // 2] if mine else None,
            "max_counted_ratio": max((r * v.weight for r, v in kept), default=None),  # what it added, ÷ the median
        }
    return summary


# ---- stage-garbler, stage-silent: three stage servers of stage 1, one the attacker's, and a trainer ---------------


def stages_run(
    attack: str | None,
    steps: int,
    check_rate: float,
    seed: int,
    *,
    stages: int = 1,
    probe_rate: float = 0.0,
    outer_h: int = 0,
    relay: bool = False,
) -> dict[str, Any]:
    """The trainer's val loss and tokens/s through three replicas of the last middle stage (``outer`` off: no round to
    wait for; with ``stages`` 2, one server of stage 1 before them); the third garbles every forward (random
    activations of the true per-token norm), takes every call and never answers (``rpc_s`` 30 s, as the issue measured
    it), or computes honestly but returns its input gradients sign-flipped (stage-gradflip). ``banned``: the trainer
    condemned it (yes), found it unfit by the loss and routed around it (unfit), or banned it for deadlines missed.
    ``outer_h``: outer rounds (DiLoCo) every ``outer_h`` inner steps; with stage-late-join, the first server trains
    alone with the trainer for ``LATE_JOIN_AT`` of the run before the others join. The honest servers' verdicts, rests,
    strikes and bans are counted in every run."""
    import dataclasses

    import torch

    from peer.data import load_corpus
    from swarm.config import TimeoutConfig, TrainerOptions
    from swarm.events import Progress
    from swarm.node.config import PeerConfig
    from swarmtest.attacks import (
        add_noise,
        collude,
        flip_backward,
        garble,
        noisy_backward,
        pass_through,
        silence,
    )
    from swarmtest.configs import DATA, LOOPBACK_MADDRS, outer_config, tiny_config
    from swarmtest.node import BackgroundNode

    def trained(node: BackgroundNode) -> int:
        records = node.events(Progress)
        return int(records[-1].get("step") or 0) if records else 0

    torch.set_num_threads(1)
    timeouts = TimeoutConfig(rpc_s=30.0, matchmaking_s=2.0, announce_period_s=1.0, record_ttl_s=4.0)
    if outer_h:
        cfg = outer_config("diloco", inner_steps=outer_h, stages=stages, steps=steps, timeouts=timeouts)
    else:
        cfg = tiny_config(stages=stages, steps=steps, outer={"method": "none"}, timeouts=timeouts)

    def data(cfg: Any, peer_id: str) -> Any:
        corpus = load_corpus([DATA])
        kw = dict(batch_size=cfg.train.microbatch_size, seq_len=cfg.train.seq_len)
        return corpus.sample_batches("train", seed=1 + seed, **kw), corpus.val_batches(num_sequences=64, **kw)

    def stage(index: int, letter: str, joined: list[str]) -> BackgroundNode:
        config = PeerConfig(
            role="stage", stage=index, name=f"stage{index}-{letter}", host_maddrs=LOOPBACK_MADDRS, initial_peers=joined
        )
        return BackgroundNode(config if letter != "x" else dataclasses.replace(config, max_pending=10**6), cfg)

    # (stage, letter): one server of stage 1 before the last stage's three, where there are two; the attacker's last
    layout = [*([(1, "a")] if stages == 2 else []), *((stages, letter) for letter in ("a", "b", "x"))]
    late = attack == "stage-late-join"
    first = stage(*layout[0], []).start()
    servers = [first, *(stage(index, letter, first.maddrs) for index, letter in layout[1:])]
    for server in servers[1:] if not late else []:
        server.start()
    try:
        if not late:
            attacker = servers[-1].call(lambda node: asyncio.sleep(0, node.role.holder))
            attacker_id = servers[-1].call(lambda node: asyncio.sleep(0, node.dht.peer_id))
            accomplice_id = servers[-2].call(lambda node: asyncio.sleep(0, node.dht.peer_id))
        if attack == "stage-garbler":
            garble(attacker)
        elif attack == "stage-silent":
            silence(attacker)
        elif attack == "stage-gradflip":
            flip_backward(attacker)
        elif attack == "stage-lazy":
            pass_through(attacker)
        elif attack == "stage-noise":
            add_noise(attacker)
        elif attack == "stage-gradnoise":
            noisy_backward(attacker)
        elif attack == "stage-collude":
            collude(attacker, servers[-2].call(lambda node: asyncio.sleep(0, node.role.holder)))
        options = TrainerOptions(check_rate=check_rate, probe_rate=probe_rate, relay=relay)
        trainer = PeerConfig(
            role="trainer",
            name="trainer",
            initial_peers=first.maddrs,
            host_maddrs=LOOPBACK_MADDRS,
            steps=steps,
            trainer=options,
        )
        with BackgroundNode(trainer, data=data) as peer:
            if late:  # the first server trains alone with the trainer, then the others join
                peer.wait("the trainer a quarter through", lambda: trained(peer) >= LATE_JOIN_AT * steps or None, 300)
                for server in servers[1:]:
                    server.start()
            last = peer.result(timeout=600)
            checker = peer.node.role.holder.remote.audit.checker  # type: ignore[union-attr]
        outer_counts = [server.events(Progress)[-1].counters if server.events(Progress) else {} for server in servers]
        server_ids = [str(server.call(lambda node: asyncio.sleep(0, node.dht.peer_id))) for server in servers]
    finally:
        for server in servers:
            server.stop()
    attackers = (
        [] if late or attack is None else [attacker_id, accomplice_id] if attack == "stage-collude" else [attacker_id]
    )
    honest = set(server_ids) - set(map(str, attackers))
    condemned = bool(attackers) and all(str(peer) in last["condemned"] for peer in attackers)
    banned = condemned if attack != "stage-silent" else last["deadline_bans"] > 0
    rested = all(checker.rests[peer] for peer in attackers) and bool(attackers)
    honest_outcome = {  # what befell the honest servers: issue 42 wants none of it in a clean run
        "honest_condemned": sum(peer in honest for peer in last["condemned"]),
        "honest_rests": sum(n for peer, n in checker.rests.items() if str(peer) in honest),
        # strikes given and verdicts counted by every server of the stage, against anyone: all against honest peers
        # in a clean run (where they must be 0), against the attacker too in an attacked one
        "outer_strikes_given": sum(c.get("outer_strikes", 0) for c in outer_counts),
        "outer_verdicts_counted": sum(c.get("outer_condemned", 0) for c in outer_counts),
        "deadline_bans": last["deadline_bans"],
    }
    keys = ("tokens_per_s", "step", "failed", "checks", "check_disagreements", "check_strikes", "checks_unresolved")
    keys += ("check_failures", "check_rests", "checks_behind")
    keys += ("probes", "probe_failures", "resent_inputs")
    keys += ("hop_timeouts", "deadline_bans", "hop_failures")
    return {
        "banned": ("yes" if banned else "unfit" if rested else "no") if attackers else "n.a.",
        "identities": len(attackers),
        **honest_outcome,
        "rounds_done": [c.get("outer_done", 0) for c in outer_counts] if outer_h else None,
        "metric": "val_loss",
        "value": last.get("val_loss"),
        "rounds": None,
        "check_rate": check_rate,
        **{key: last.get(key) for key in keys},
    }


# ---- state-liar, round-staller, pg-x1000: honest replicas of stage 1 in outer rounds -----------------------------


STEP_EVERY_S = 0.3  # an inner step runs on the event loop: leave the rounds' traffic room between steps


class TrainingHolder:
    """A ``Holder`` of stage 1 (``RandomStepHolder``'s interface) whose inner step is a real one: the replica
    trains its own stage 0 and stage 1 on its own microbatches (stage 0 never syncs), so the honest outcome of an
    outer attack is a validation loss, that of the replica's whole model, as in the pipeline attacks."""

    steps = 60  # inner steps each replica takes (``--steps``); the lr schedule's length
    val_batches: list[Any] = []
    go = False  # set once every replica has joined: they train side by side, as a stage's replicas do

    def __init__(self, cfg: Any, seed: int) -> None:
        from peer.data import load_corpus
        from swarm.pipeline.boundary import Link, boundary_codecs
        from swarm.sim.simulate import make_replica
        from swarmtest.configs import DATA

        corpus = load_corpus([DATA])
        kw = dict(batch_size=cfg.train.microbatch_size, seq_len=cfg.train.seq_len)
        self.stream = corpus.sample_batches("train", seed=seed, **kw)
        TrainingHolder.val_batches = TrainingHolder.val_batches or corpus.val_batches(num_sequences=64, **kw)
        self.edge, self.middle = (make_replica(cfg, stage, self.steps, with_outer=False) for stage in (0, 1))
        self.module = self.middle.module  # what the outer step syncs
        self.link = Link(*boundary_codecs(cfg))
        self.inner_steps = self.start_step = 0

    async def exclusive(self, fn: Any, *, change: str = "none") -> Any:
        return fn()  # inner steps run on the event loop too: nothing overlaps

    def train(self) -> None:
        from swarm.sim.simulate import train_microbatch

        if self.go and self.inner_steps < self.steps:
            train_microbatch(self.edge, [self.middle], next(self.stream), self.link)
            self.inner_steps = self.middle.inner.steps

    def val_loss(self) -> float:
        from swarm.sim.simulate import full_pipeline_loss

        return full_pipeline_loss({0: [self.edge], 1: [self.middle]}, 1, self.val_batches)


def adaptive_payload(outer: Any, how: float | str) -> None:
    """Make replica ``outer`` send, every round, ``how`` × its own Δ (a float) or its Δ rolled by one coordinate × 9
    ("roll9"): what an attacker who read the ×10 norm screen sends."""
    import torch

    make_payload = outer.make_payload

    def attacked(local: Any) -> bytes:
        own = {name: g - local[name] for name, g in outer.global_params.items()}
        sent = {n: 9.0 * torch.roll(d, 1, dims=-1) if how == "roll9" else float(how) * d for n, d in own.items()}
        return make_payload({name: g - sent[name] for name, g in outer.global_params.items()})

    outer.make_payload = attacked


def outer_run(
    attack: str | None,
    steps: int,
    timeout_s: float,
    seed: int,
    *,
    replicas: int = 2,
    method: str = "diloco",
    trace: Path | None = None,
) -> dict[str, Any]:
    import torch

    from swarm.events import OuterStrike, StateDownload, of_kind
    from swarm.outer.group import RoundTiming
    from swarmtest.attacks import garbage_weights, start_round_staller, start_state_liar
    from swarmtest.configs import LOOPBACK_ROUND_TIMEOUTS, outer_config
    from swarmtest.loopback import LoopbackReplica, largest_norm_ratio, seeded_weights, stopping

    def start(name: str, cfg: Any, initial_peers: list[str], *, seed: int) -> Any:
        """A replica that trains on text instead of random steps, an inner step every STEP_EVERY_S."""
        return LoopbackReplica.start(
            name, cfg, initial_peers, seed=seed, make_holder=TrainingHolder, step_every_s=STEP_EVERY_S
        )

    TrainingHolder.steps = steps
    torch.set_num_threads(1)
    cfg = outer_config(method, timeouts=LOOPBACK_ROUND_TIMEOUTS)  # type: ignore[arg-type]  # a choice of --outer
    seeded = seeded_weights(cfg)

    async def scenario() -> dict[str, Any]:
        a = await start("a", cfg, [], seed=1 + 2 * seed)
        extra: list[Any] = []
        outcome: dict[str, Any] = {"banned": "n.a."}
        pair_attack = attack in ("pg-x1000", "pg-flip9-pair", "pg-orthogonal-pair")
        b = await start("x" if pair_attack else "b", cfg, a.peer.maddrs, seed=2 + 2 * seed)
        if attack == "pg-x1000":  # b is the attacker: 1000 × its Δ = θ_global − θ_local, every round
            outer, make_payload = b.sync.outer, b.sync.outer.make_payload
            outer.make_payload = lambda local: make_payload(
                {name: g - 1000.0 * (g - local[name]) for name, g in outer.global_params.items()}
            )
        elif pair_attack and attack is not None:
            adaptive_payload(b.sync.outer, ADAPTIVE_PG[attack])
        more = [
            await start(f"c{i}", cfg, a.peer.maddrs, seed=100 + 2 * seed + i) for i in range(replicas - 2)
        ]  # 3 or 5 replicas: the last one (or two) the attackers'
        attackers = more[-(2 if replicas == 5 else 1) :] if attack in ADAPTIVE_PG and not pair_attack else []
        for r in attackers:
            adaptive_payload(r.sync.outer, ADAPTIVE_PG[str(attack)])
        if attackers:
            outcome.update(identities=len(attackers))
        stallers = []
        if attack == "round-staller":  # two identities declare every round long opened (60 s, or what a round can have)
            ago_s = min(60.0, RoundTiming.of(cfg.timeouts).max_round_s - 1.5)
            stallers = [await start_round_staller(cfg, a.peer.maddrs, [a, b], ago_s=ago_s) for _ in range(2)]
            outcome.update(identities=2, declared_ago_s=ago_s)
        TrainingHolder.go = True
        if attack == "state-liar":  # mid-run: two colluding identities announce round 10⁶ and serve garbage weights
            deadline = time.monotonic() + 60
            while not all(r.rounds() for r in (a, b)) and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            garbage = garbage_weights(cfg)  # the seeded weights' norms: no norm check tells them apart
            for name in ("liar1", "liar2"):
                liar = await start_state_liar(cfg, a.peer.maddrs, round_=10**6, scale=1.0, weights=garbage, name=name)
                extra.append(liar)
            outcome.update(identities=2)
        try:
            async with stopping(a, b, *more, *extra):
                honest = [a] if pair_attack else [r for r in (a, b, *more) if r not in attackers]
                deadline = time.monotonic() + timeout_s
                while min(r.holder.inner_steps for r in honest) < steps and time.monotonic() < deadline:
                    await asyncio.sleep(0.2)
                await asyncio.sleep(2 * cfg.timeouts.matchmaking_s)  # the last round settles
                if pair_attack or attackers:
                    bans = [e for e in of_kind(a.events, OuterStrike) if e.banned]
                    bad = {r.peer.id for r in attackers} or {b.peer.id}
                    outcome["banned"] = "yes" if bad <= {e.peer for e in bans} else "no"
                ids = {liar.id for liar in extra} | {dht.peer_id.to_base58() for dht in stallers}
                if ids:  # every attacker identity struck, and banned, by every honest replica?
                    strikes = [[e for e in of_kind(r.events, OuterStrike) if e.peer in ids] for r in honest]
                    struck = all({e.peer for e in s} == ids for s in strikes)
                    banned = all({e.peer for e in s if e.banned} == ids for s in strikes)
                    outcome["banned"] = "yes" if banned else "struck" if struck else "no"
                if attack == "state-liar":
                    took = [e for r in honest for e in of_kind(r.events, StateDownload) if e.from_peer in ids]
                    outcome["adopted"] = bool(took) or any(r.sync.round >= 1000 for r in honest)
                ratios = [largest_norm_ratio(r.weights(), seeded) for r in honest]
                losses = [r.holder.val_loss() for r in honest]
                if trace is not None:
                    write_trace(trace, (a, b, *more))
                return {
                    **outcome,
                    "metric": "val loss",
                    "value": sum(losses) / len(losses),
                    "val_losses": losses,
                    "inner_steps": [r.holder.inner_steps for r in honest],
                    "weight_norm_ratio": max(ratios),
                    "rounds": min(len(r.rounds()) for r in honest),
                    "rounds_together": min(len(r.rounds(contributors=2)) for r in honest),
                    "finite": all(math.isfinite(x) for x in ratios + losses),
                }
        finally:
            for staller in stallers:
                staller.stall.cancel()
                await asyncio.to_thread(staller.shutdown)

    return asyncio.run(scenario())


# ---- memory-bomb: a real OuterOptimizer decodes a round's payloads --------------------------------------------


def memory_bomb_run(attack: str | None) -> dict[str, Any]:
    import torch

    from compress.config import CodecConfig
    from compress.wire import CodecId, decode_frame
    from optim.config import OuterOptimConfig
    from optim.factory import build_outer_optimizer
    from optim.payload import max_payload_bytes, pack_payload, unpack_payload
    from swarmtest.attacks import bomb_frame

    peaks, dropped, equal = {}, 0, True
    for method in ("sparseloco", "diloco"):
        torch.manual_seed(6)
        codecs = CodecConfig(pseudo_gradients="fp32" if method == "diloco" else "sparseloco")
        start = {"w": torch.randn(64, 64)}
        reference = build_outer_optimizer(start, OuterOptimConfig(method=method), codecs)
        opt = build_outer_optimizer(start, OuterOptimConfig(method=method), codecs)
        payloads = [reference.make_payload({"w": start["w"] - torch.randn(64, 64)}) for _ in range(2)]
        if attack:
            round_, frames = unpack_payload(payloads[0], max_bytes=max_payload_bytes(start))
            if method == "sparseloco":
                shape = (1, 64 << 20)
                meta = decode_frame(frames["w"]).meta
                bomb = bomb_frame(CodecId.SPARSELOCO, shape, meta, opt.codec.limits_for(shape).max_body_bytes)
            else:
                bomb = bomb_frame(CodecId.FP32, (4096, 4096), b"", 4 * 4096 * 4096)
            payloads = [*payloads, pack_payload(round_, {"w": bomb})]
        reference.apply(payloads[:2], {"w": start["w"].clone()})
        tracemalloc.start()
        try:
            used = opt.apply(payloads, {"w": start["w"].clone()}).used
            peaks[method] = tracemalloc.get_traced_memory()[1] / 1e6
        finally:
            tracemalloc.stop()
        dropped += len(payloads) - used
        equal = equal and torch.equal(opt.global_params["w"], reference.global_params["w"])
    return {
        "banned": ("yes" if dropped == 2 else "no") if attack else "n.a.",
        "metric": "global_params_equal",
        "value": 1.0 if equal else math.nan,
        "rounds": None,
        "tracemalloc_peak_mb": peaks,
        "peak_mb": max(peaks.values()),
    }


def child(attack: str, variant: str, args: argparse.Namespace) -> dict[str, Any]:
    """One run (``variant``: clean or attack) in this process; what it measured."""
    import logging

    logging.disable(logging.WARNING)  # the attacks make the honest peers warn a lot; the numbers are the point
    trace = None
    if args.trace is not None:  # this run's outer rounds and its optimizers' screening, for reading after
        trace = args.trace.with_name(f"{args.trace.name}-{attack}-{variant}-s{args.seed}")
        handler = logging.FileHandler(trace.with_suffix(".log"))
        handler.setFormatter(logging.Formatter("%(asctime)s %(threadName)s %(name)s %(message)s"))
        for name in ("optim.outer", "swarm.outer"):
            logging.getLogger(name).setLevel(logging.INFO)
            logging.getLogger(name).addHandler(handler)
        logging.disable(logging.NOTSET)
    if args.undefended:
        undefend()
    name = attack if variant == "attack" else None
    started = time.monotonic()
    if attack in PIPELINE:
        result = pipeline_run(name, args.steps, args.seed)
    elif attack in STAGES | STAGES2 | STAGES_OUTER:
        # backward probes on at the check rate, unless undefended
        probe_rate = 0.0 if args.undefended else args.check_rate
        stages = (
            2 if attack in STAGES2 or args.relay else 1
        )  # --relay: the attacked stage's input comes server to server
        outer_h = LATE_JOIN_H if attack in STAGES_OUTER else args.stage_outer_h
        result = stages_run(
            name,
            args.steps,
            args.check_rate,
            args.seed,
            stages=stages,
            probe_rate=probe_rate,
            outer_h=outer_h,
            relay=args.relay,
        )
    elif attack in OUTER | OUTER3 | OUTER5:
        replicas = 3 if attack in OUTER3 else 5 if attack in OUTER5 else 2
        result = outer_run(
            name, args.steps, args.timeout - 30, args.seed, replicas=replicas, method=args.outer, trace=trace
        )
    elif attack in DRAIN:
        result = drain_run(name, args.seed, undefended=args.undefended)
    else:
        result = memory_bomb_run(name)
    result["wall_s"] = time.monotonic() - started
    result.setdefault("peak_mb", peak_rss_mb())
    return result


def drain_run(attack: str | None, seed: int, *, undefended: bool) -> dict[str, Any]:
    """state-drain: ``scripts/bench_drain.py``'s holder at real size for 600 s (its ``count`` limits if undefended)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_drain import LIMITS, run

    limits = LIMITS["count" if undefended else "bytes"]
    result = asyncio.run(run(attack is not None, limits, seed=seed, duration_s=600.0, round_s=120.0))
    return {"metric": "joiner_download_s", "value": result["joiner_download_s"], "rounds": None} | result


def write_trace(path: Path, replicas: Iterable[Any]) -> None:
    """Every replica's outer events to ``path``.events, one JSON line each, peers named a, b, c, … in start order."""
    replicas = list(replicas)
    names = {r.peer.id: name for name, r in zip("abcdefghij", replicas)}

    def named(value: Any) -> Any:
        if isinstance(value, str):
            return names.get(value, value)
        return [named(v) for v in value] if isinstance(value, (tuple, list)) else value

    with path.with_suffix(".events").open("w") as out:
        for r in replicas:
            for event in r.events:
                fields = {key: named(value) for key, value in vars(event).items()}
                print(
                    json.dumps({"replica": names[r.peer.id], "kind": type(event).__name__, **fields}, default=str),
                    file=out,
                )


def undefend() -> None:
    """Issue 42's outer defences off, in this process: no centred clip, no pair guard or bound, SparseLoCo members not
    bounded to the median member's norm (the baseline the attacks are
    measured against without them; the stage scenarios run without backward probes then)."""
    import math

    import optim.outer

    optim.outer.CENTRE_RADIUS = math.inf
    optim.outer.PAIR_BOUND_RATIO = math.inf
    optim.outer.OuterOptimizer._guard_pair = lambda self, members: (members, {})  # type: ignore[method-assign]
    optim.outer.SparseLoCo.bounded_by_median = False  # type: ignore[misc]


def spawn(attack: str, variant: str, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    command = [sys.executable, __file__, "--child", attack, variant, "--steps", str(args.steps), "--seed", str(seed)]
    command += ["--timeout", str(args.timeout), "--check-rate", str(args.check_rate), "--outer", args.outer]
    command += ["--stage-outer-h", str(args.stage_outer_h)]
    command += ["--undefended"] if args.undefended else []
    command += ["--relay"] if args.relay else []
    command += ["--trace", str(args.trace)] if args.trace else []
    done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {"error": f"exit {done.returncode}: {done.stderr[-1500:]}", "seed": seed}


CLEAN_OF: dict[str, str] = {
    **{a: "pipeline" for a in PIPELINE},
    **{a: "outer" for a in OUTER},
    **{a: "outer3" for a in OUTER3},
    **{a: "outer5" for a in OUTER5},
    **{a: "stages" for a in STAGES},
    **{a: "stages2" for a in STAGES2},
    **{a: "stages-outer" for a in STAGES_OUTER},
    **{a: "drain" for a in DRAIN},
}


def ratio(a: Any, b: Any) -> float | None:
    return a / b if isinstance(a, int | float) and isinstance(b, int | float) and b else None


def row(attack: str, clean: dict[str, Any], hit: dict[str, Any]) -> dict[str, Any]:
    return {
        "attack": attack,
        "metric": hit.get("metric"),
        "clean": clean.get("value"),
        "attacked": hit.get("value"),
        "ratio": ratio(hit.get("value"), clean.get("value")),
        "rounds_clean": clean.get("rounds"),
        "rounds_attacked": hit.get("rounds"),
        "banned": hit.get("banned"),
        "identities": hit.get("identities", 1),
        "screened": hit.get(
            "attacker"
        ),  # grad-570x-sybil: the stage's screen on the attackers' and honest microbatches
        "peak_mb_clean": clean.get("peak_mb"),
        "peak_mb_attacked": hit.get("peak_mb"),
        "peak_ratio": ratio(hit.get("peak_mb"), clean.get("peak_mb")),
        "clean_run": clean,
        "attack_run": hit,
    }


def fmt(x: Any, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec) if isinstance(x, float) else str(x)


def print_table(rows: list[dict[str, Any]]) -> None:
    head = (
        f"{'attack':<16} {'seed':>4} {'metric':<20} {'clean':>7} {'attacked':>8} {'ratio':>6} {'rounds':>7} "
        f"{'banned':>6} {'ids':>3} {'peak MB':>13} {'×':>5}"
    )
    print(head)
    for r in rows:
        rounds = "-" if r["rounds_attacked"] is None else f"{r['rounds_attacked']}/{r['rounds_clean']}"
        peak = f"{fmt(r['peak_mb_attacked'], '.1f')}/{fmt(r['peak_mb_clean'], '.1f')}"
        print(
            f"{r['attack']:<16} {r['seed']:>4} {r['metric'] or 'error':<20} {fmt(r['clean'])!s:>7} "
            f"{fmt(r['attacked']):>8} {fmt(r['ratio']):>6} {rounds:>7} {r['banned'] or '-':>6} {r['identities']:>3} "
            f"{peak:>13} {fmt(r['peak_ratio'], '.2f'):>5}"
        )


def spread(values: list[Any]) -> dict[str, Any]:
    """Mean, sample standard deviation, min and max of the numbers among ``values`` (None where there are none)."""
    xs = [v for v in values if isinstance(v, int | float) and math.isfinite(v)]
    if not xs:
        return {"n": 0, "mean": None, "std": None, "min": None, "max": None}
    mean = sum(xs) / len(xs)
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
    return {"n": len(xs), "mean": mean, "std": std, "min": min(xs), "max": max(xs)}


def summaries(rows: list[dict[str, Any]], cleans: dict[tuple[str, int], dict[str, Any]]) -> dict[str, Any]:
    """Per clean group, its outcome over seeds; per attack, its ratio to the clean run of the same seed over seeds."""
    groups = sorted({group for group, _ in cleans})
    clean = {g: spread([c.get("value") for (group, _), c in cleans.items() if group == g]) for g in groups}
    attacks = {
        a: spread([r["ratio"] for r in rows if r["attack"] == a]) for a in dict.fromkeys(r["attack"] for r in rows)
    }
    # what befell honest servers (stage scenarios): summed over the clean runs of each group, and over each attack's runs
    honest = {f"clean {g}": honest_totals([c for (group, _), c in cleans.items() if group == g]) for g in groups} | {
        a: honest_totals([r["attack_run"] for r in rows if r["attack"] == a]) for a in attacks
    }
    return {"clean": clean, "ratio": attacks, "honest": {k: v for k, v in honest.items() if v}}


HONEST_KEYS = ("honest_condemned", "honest_rests", "outer_strikes_given", "outer_verdicts_counted", "deadline_bans")


def honest_totals(runs: list[dict[str, Any]]) -> dict[str, int]:
    """The honest servers' verdicts, rests, strikes and bans summed over ``runs`` (empty: no stage scenario)."""
    runs = [r for r in runs if "honest_rests" in r]
    return {"runs": len(runs), **{key: sum(r.get(key) or 0 for r in runs) for key in HONEST_KEYS}} if runs else {}


def print_summaries(summary: dict[str, Any]) -> None:
    for title, table in (
        ("clean runs (outcome over seeds)", summary["clean"]),
        ("attacked/clean ratio", summary["ratio"]),
    ):
        print(f"\n{title}:")
        for name, s in table.items():
            if s["n"]:
                print(
                    f"  {name:<16} n={s['n']} mean {s['mean']:.4f} ± {s['std']:.4f} (min {s['min']:.4f}, max {s['max']:.4f})"
                )
    if summary.get("honest"):
        print(
            "\nhonest servers condemned and found unfit, the stage's outer strikes and verdicts, deadline bans, summed:"
        )
        for name, totals in summary["honest"].items():
            print(f"  {name:<22} " + ", ".join(f"{key} {n}" for key, n in totals.items()))


def main() -> None:
    from peer.local_swarm import LocalSwarm
    from swarm.cli_fields import add_field_arguments
    from swarm.config import TrainerOptions

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=ATTACKS, default=list(ATTACKS))
    add_field_arguments(parser, LocalSwarm, "steps", defaults={"steps": 60})  # every honest trainer and replica's
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds one run may take")
    parser.add_argument("--json", type=Path)
    # the trainers' in stage-garbler/-silent; --relay: stage-* trainers send frames server to server (2 stages)
    add_field_arguments(parser, TrainerOptions, "check_rate", "relay")
    parser.add_argument("--seeds", type=int, default=1, help="data seeds: each attack and its clean run once per seed")
    parser.add_argument("--clean-seeds", type=int, default=0, help="extra seeds of the clean runs only (their spread)")
    parser.add_argument(
        "--outer", choices=("diloco", "sparseloco"), default="diloco", help="the outer method of the outer scenarios"
    )
    parser.add_argument(
        "--stage-outer-h",
        type=int,
        default=0,
        help="the stage scenarios' servers in DiLoCo rounds every H inner steps (0: outer off, their replicas never sync)",
    )
    parser.add_argument(
        "--undefended",
        action="store_true",
        help="issue 42's defences off (centred clip, pair guard, SparseLoCo's median-norm bound, backward probes)",
    )
    parser.add_argument(
        "--trace",
        type=Path,
        help="outer scenarios: write each run's events (PREFIX-ATTACK-VARIANT-sSEED.events, JSON lines, replicas named a, "
        "b, c… in start order) and its optimizers' screening log (.log) next to PREFIX",
    )
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)  # a child's seed
    parser.add_argument("--child", nargs=2, metavar=("ATTACK", "VARIANT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child, args)), flush=True)
        return
    import os

    cleans: dict[tuple[str, int], dict[str, Any]] = {}
    rows, loads = [], []
    for seed in range(args.seeds):
        for attack in args.only:
            group = CLEAN_OF.get(attack, attack)
            if (group, seed) not in cleans:
                cleans[group, seed] = spawn(attack, "clean", args, seed)
                loads.append(os.getloadavg()[0])
            hit = spawn(attack, "attack", args, seed)
            loads.append(os.getloadavg()[0])
            rows.append(row(attack, cleans[group, seed], hit) | {"seed": seed})
            shown = {k: v for k, v in rows[-1].items() if not k.endswith("_run")}
            print(f"{attack} seed {seed}: {json.dumps(shown)}", flush=True)
    groups = {CLEAN_OF[a]: a for a in args.only if a in CLEAN_OF}  # each clean run, by one of its attacks
    for seed in range(args.seeds, args.seeds + args.clean_seeds):  # the clean runs' spread over more seeds
        for group, attack in groups.items():
            cleans[group, seed] = spawn(attack, "clean", args, seed)
            loads.append(os.getloadavg()[0])
            print(f"clean {group} seed {seed}: value {cleans[group, seed].get('value')}", flush=True)
    print()
    print_table(rows)
    for r in rows:  # state-drain: the drainer's share of the holder's upload
        if (share := r["attack_run"].get("drainer_share_of_upload")) is not None:
            fair = r["attack_run"]["fair_share"]
            print(
                f"{r['attack']} seed {r['seed']}: the drainer took {share:.1%} of the holder's upload (fair {fair:.0%})"
            )
    summary = summaries(rows, cleans)
    print_summaries(summary)
    load = {"mean_1min": sum(loads) / len(loads), "max_1min": max(loads), "cpus": os.cpu_count()}
    print(f"load average (1 min) during the runs: mean {load['mean_1min']:.1f}, max {load['max_1min']:.1f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        cleans_out = [c | {"group": g, "seed": s} for (g, s), c in cleans.items()]
        record = {"rows": rows, "cleans": cleans_out, "summary": summary, "load": load}
        args.json.write_text(json.dumps(record | {"args": vars(args) | {"json": str(args.json)}}, indent=1) + "\n")


if __name__ == "__main__":
    main()
