"""Peers behind NAT: how a peer decides how others reach it, and (in the WAN lab) that peers behind a firewall which
lets no connection in still serve and train."""

from __future__ import annotations

from pathlib import Path

import pytest
from swarm_harness import DATA, records, tiny_config

from peer.launch import LocalSwarm, Placement, launch_local
from scripts.wanlab import WanLab, unsupported_reason
from swarm.config import TimeoutConfig
from swarm.dht.reachability import Reachability, choose_reachability
from swarm.errors import ConfigError
from swarm.peer_config import PeerConfig

PEER_ID = "12D3KooWEkdmeNHf5ezZeNHf1gq43NwBUadEVHipznHjrwpxh5h1"
PUBLIC_PEER = f"/ip4/203.0.113.7/tcp/31337/p2p/{PEER_ID}"
ANY = ["/ip4/0.0.0.0/tcp/0"]


def auto(initial_peers: list[str], host_maddrs: list[str] = ANY, announce: list[str] = (), local=("192.168.1.5",)):
    return choose_reachability(
        "auto", initial_peers=initial_peers, host_maddrs=host_maddrs, announce_maddrs=announce, local_addresses=local
    )


def test_auto_chooses_a_relay_only_when_nothing_says_others_can_dial_this_peer() -> None:
    behind_nat = auto([PUBLIC_PEER])
    assert behind_nat.mode == "relay" and "192.168.1.5" in behind_nat.reason
    assert behind_nat.describe().startswith("reachability: relay (no --announce-maddrs")
    assert auto([PUBLIC_PEER], announce=["/ip4/203.0.113.9/tcp/4000"]).mode == "public"
    assert auto([]).mode == "public"  # it creates the swarm
    assert auto([PUBLIC_PEER], local=("198.51.100.20", "8.8.4.4")).mode == "public"  # it has a public address
    assert auto([f"/ip4/192.168.1.40/tcp/31337/p2p/{PEER_ID}"]).mode == "public"  # a LAN swarm
    assert auto([f"/ip4/127.0.0.1/tcp/31337/p2p/{PEER_ID}"], ["/ip4/127.0.0.1/tcp/0"]).mode == "public"
    assert auto([f"/ip4/10.9.0.1/tcp/31337/p2p/{PEER_ID}"], ["/ip4/10.77.0.2/tcp/0"]).mode == "relay"
    asked = choose_reachability("client", initial_peers=[], host_maddrs=ANY, announce_maddrs=[])
    assert asked == Reachability("client", "as asked with --reachability")
    with pytest.raises(ValueError, match="must be one of auto, public, relay, client"):
        choose_reachability("nat", initial_peers=[], host_maddrs=ANY, announce_maddrs=[])  # type: ignore[arg-type]


def test_a_peer_behind_nat_is_a_dht_client_that_reserves_a_slot_on_its_initial_peers() -> None:
    options = Reachability("relay", "").dht_options([PUBLIC_PEER])
    assert options == {
        "client_mode": True,
        "use_auto_relay": True,
        "force_reachability": "private",
        "trusted_relays": [PUBLIC_PEER],
    }
    assert Reachability("public", "").dht_options([PUBLIC_PEER]) == {"force_reachability": "public"}  # a relay itself


def test_a_client_cannot_be_a_stage_server() -> None:
    with pytest.raises(ConfigError, match="use --reachability relay"):
        PeerConfig(role="stage", stage=1, reachability="client", initial_peers=[PUBLIC_PEER])
    with pytest.raises(ConfigError, match="reachability"):
        PeerConfig(reachability="nat")  # type: ignore[arg-type]
    assert PeerConfig(role="auto", reachability="client").chosen_reachability().mode == "client"


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(unsupported_reason() is not None, reason=unsupported_reason() or "")
def test_peers_behind_a_firewall_serve_and_train_in_the_wan_lab(tmp_path: Path) -> None:
    """Hosts 1 and 3 let no connection in (their SYN-ACKs are dropped): the stage server there (--reachability relay)
    joins and serves stage 1, and the trainer there (--reachability client) still trains to its last step. The two of them cannot reach each other without a working relay circuit, which the test
    does not require (README: Behind NAT, known limit)."""
    cfg = tiny_config(timeouts=TimeoutConfig(announce_period_s=1.0))
    layout = LocalSwarm(peers=4, stages=1, trainers=2, steps=12)
    with WanLab(caps_mbit=[None] * 4, prefix="slabtest-nat-") as lab:
        for host in (1, 3):
            lab.block_inbound(host)
        where = {"stage1-0": (0, ()), "stage1-1": (1, ("--reachability", "relay"))}
        where |= {"trainer-0": (2, ()), "trainer-1": (3, ("--reachability", "client"))}
        hosts = {
            name: Placement(prefix=tuple(lab.command(i, [])), host=lab.hosts[i].address, args=args)
            for name, (i, args) in where.items()
        }
        code = launch_local(
            layout, out=tmp_path, config=cfg, data=[DATA], place=hosts.__getitem__, echo=lambda line: None
        )
    logs = {name: (tmp_path / f"{name}.log").read_text() for name in where}
    assert code == 0, logs["trainer-1"][-3000:]
    assert "reachability: client (as asked with --reachability)" in logs["trainer-1"]
    assert "reachability: relay (as asked with --reachability)" in logs["stage1-1"]
    assert "reachability: public" in logs["stage1-0"]
    for trainer in ("trainer-0", "trainer-1"):
        assert records(tmp_path, trainer)[-1]["step"] == layout.steps, logs[trainer][-3000:]
    # it joined and served as a replica of stage 1 (its records are a stage server's). Whether a trainer called it,
    # and so whether it got as far as an outer round before the 12 steps ended, is a matter of timing without a
    # relay circuit (it was 0 in one suite run of five): not asserted
    behind_firewall = [r for r in records(tmp_path, "stage1-1") if r.get("role") == "stage"]
    assert behind_firewall and "stage1-1: stage of swarm ready" in logs["stage1-1"], logs["stage1-1"][-3000:]
