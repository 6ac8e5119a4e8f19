"""``swarmloco run`` with credentials and ``swarmloco status``, end to end in subprocesses on loopback:
a private swarm trains, outsiders are refused with the reason, and start-up failures are one clear line."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from peer.credentials import create_swarm, invite, new_identity, peer_id_of_identity, revoke
from peer.status import format_status
from swarm.config import SwarmConfig, TimeoutConfig
from swarm.config_toml import save_config
from swarm.node.config import PeerConfig
from swarmtest.configs import DATA, tiny_config
from swarmtest.processes import Swarm, swarmloco

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

LOOPBACK = ["--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--threads", "1"]


def swarm_config(name: str = "demo", seed: int = 0) -> SwarmConfig:
    return tiny_config(
        name=name,
        steps=3,
        train={"seed": seed},
        inner={"warmup_steps": 2},
        timeouts=TimeoutConfig(announce_period_s=1.0, record_ttl_s=10.0),
    )


def refused(result: subprocess.CompletedProcess[str], says: str) -> str:
    """The one-line error of a failed command, checked to contain ``says``."""
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2 and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert says in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def private_swarm(tmp_path: Path) -> Path:
    """A private tiny swarm: certificates for peers a, b, s and r (r then revoked), a stale one for e, none for c."""
    create_swarm("demo", tmp_path, private=True)
    cfg = swarm_config()
    save_config(cfg, tmp_path / "swarm.toml")
    for name in "abcers":
        new_identity(tmp_path / f"{name}.id")
    for name in "abrs":
        invite(
            tmp_path / "authority.key",
            cfg.swarm_id,
            peer_id_of_identity(tmp_path / f"{name}.id"),
            days=1,
            out=tmp_path / f"{name}.cert",
        )
    invite(
        tmp_path / "authority.key",
        cfg.swarm_id,
        peer_id_of_identity(tmp_path / "e.id"),
        days=1,
        out=tmp_path / "e.cert",
        clock=lambda: time.time() - 2 * 86400,
    )
    revoke(
        tmp_path / "authority.key",
        cfg.swarm_id,
        peer_id_of_identity(tmp_path / "r.id"),
        revocations=tmp_path / "revocations.json",
    )
    return tmp_path


def peer(root: Path, name: str) -> list[str]:
    return ["--identity", str(root / f"{name}.id"), "--credentials", str(root / f"{name}.cert")]


def test_private_swarm_trains_members_and_refuses_everyone_else(private_swarm: Path, child_processes: list) -> None:
    root = private_swarm
    swarm = Swarm(root, swarm_config(), child_processes)
    first = swarm.spawn(
        "a", PeerConfig(role="stage", stage=1), *peer(root, "a"), "--revocations", str(root / "revocations.json")
    )
    join, address = swarm.join, swarm.join[1]

    trainer, status, uninvited, revoked, expired = swarmloco(
        [
            "run",
            "--role",
            "trainer",
            "--steps",
            "3",
            "--data",
            DATA,
            *join,
            *peer(root, "b"),
            *LOOPBACK,
        ],  # fetches the config by the certificate's swarm
        ["status", *join, *peer(root, "s"), "--json"],  # its own identity: two live peers may not share one
        ["run", "--role", "stage", *join, "--identity", str(root / "c.id"), *LOOPBACK],
        ["run", "--role", "stage", *join, *peer(root, "r"), *LOOPBACK],
        ["run", "--role", "stage", *join, *peer(root, "e"), *LOOPBACK],
        children=child_processes,
    )
    assert trainer.returncode == 0, trainer.stderr[-3000:]
    assert "step 3/3" in trainer.stdout and "failed 0" in trainer.stdout, (
        trainer.stdout
    )  # every hop served: the certificate went along
    assert status.returncode == 0, status.stderr
    stages = {stage["stage"]: stage["peers"] for stage in json.loads(status.stdout)["stages"]}
    assert [p["peer"] for p in stages[1]] == [peer_id_of_identity(root / "a.id")]

    c = peer_id_of_identity(root / "c.id")
    line = refused(uninvited, f"the swarm at {address} refused this peer: peer {c} presented no certificate")
    assert f"swarmloco swarm invite --peer-id {c}" in line
    refused(revoked, "refused this peer: the swarm's authority revoked peer")
    refused(expired, f"the certificate of peer {peer_id_of_identity(root / 'e.id')} expired at")  # found before joining
    assert first.poll() is None, "the swarm's peer must outlive all of this"


def test_public_swarm_status_and_start_up_errors(tmp_path: Path, child_processes: list) -> None:
    swarm = Swarm(tmp_path, swarm_config(name="open"), child_processes)
    save_config(swarm_config(name="open", seed=1), tmp_path / "other.toml")
    first = swarm.spawn("first", PeerConfig(role="stage", stage=1, identity=tmp_path / "first.id"))
    join, address = swarm.join, swarm.join[1]
    new_identity(tmp_path / "m.id")
    create_swarm("open", tmp_path / "authority", private=True)
    invite(
        tmp_path / "authority" / "authority.key",
        swarm_config(name="open").swarm_id,
        peer_id_of_identity(tmp_path / "m.id"),
        days=1,
        out=tmp_path / "m.cert",
    )
    unreachable = address.replace(address.split("/tcp/")[1].split("/")[0], "1", 1)

    status, twin, lost, mismatch, certified = swarmloco(
        ["status", *join, "--swarm", "open", "--json"],
        ["run", "--role", "stage", *join, "--identity", str(tmp_path / "first.id"), *LOOPBACK],
        ["run", "--role", "stage", "--initial-peers", unreachable, *LOOPBACK],
        ["run", "--role", "stage", *join, "--config", str(tmp_path / "other.toml"), *LOOPBACK],
        [
            "run",
            "--role",
            "stage",
            *join,
            "--identity",
            str(tmp_path / "m.id"),
            "--credentials",
            str(tmp_path / "m.cert"),
            *LOOPBACK,
        ],
        children=child_processes,
    )
    assert status.returncode == 0, status.stderr
    result = json.loads(status.stdout)
    assert result["swarm_id"] == swarm_config(name="open").swarm_id and result["peers"] == 1
    assert [p["peer"] for p in result["stages"][1]["peers"]] == [address.rsplit("/p2p/", 1)[1]]
    assert f"swarm {result['swarm_id']}: 1 middle stage, 1 peer" in format_status(result)

    refused(twin, f"the identity {tmp_path / 'first.id'} is in use by another running peer")
    refused(lost, f"could not reach any initial peer (tried {unreachable})")
    line = refused(mismatch, f"runs config {swarm_config(name='open').hash()} but this peer's config hashes to")
    assert swarm_config(name="open", seed=1).hash() in line
    refused(certified, "is public, but this peer runs with --credentials")
    assert first.poll() is None


def test_status_text_shows_peers_throughput_and_rounds_per_stage() -> None:
    row = dict(samples_per_s=0.0, queue=0, inner_steps=40, outer_round=3)
    status = {
        "swarm_id": "demo-0123456789abcdef",
        "num_stages": 2,
        "peers": 3,
        "stages": [
            {
                "stage": 0,
                "peers": [{"peer": "QmT", **row, "tokens_per_s": 5100.0, "train_loss": 2.5}],
                "samples_per_s": 0.0,
                "tokens_per_s": 5100.0,
            },
            {
                "stage": 1,
                "peers": [
                    {"peer": "QmA", **row, "samples_per_s": 10.0},
                    {"peer": "QmB", **row, "samples_per_s": 5.5, "outer_round": 4},
                ],
                "samples_per_s": 15.5,
                "tokens_per_s": 0.0,
            },
            {"stage": 2, "peers": [], "samples_per_s": 0.0, "tokens_per_s": 0.0},
        ],
    }
    lines = format_status(status).splitlines()
    assert lines[0] == "swarm demo-0123456789abcdef: 2 middle stages, 3 peers"
    assert lines[1].split() == ["stage", "0", "(trainers)", "1", "peer", "5.1k", "tok/s", "outer", "round", "3"]
    assert "loss 2.500" in lines[2]
    assert lines[3].split() == ["stage", "1", "2", "peers", "15.5", "samples/s", "outer", "round", "3-4"]
    assert lines[-1].startswith("stage 2") and "no peers: trainers skip it" in lines[-1]
