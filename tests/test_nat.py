"""Peers behind NAT: how a peer decides how others reach it, and (in the WAN lab) that peers behind a firewall which
lets no connection in still serve and train."""

from __future__ import annotations

from pathlib import Path

import pytest
from hivemind.p2p import P2P

from peer.launch import READY_PREFIX, LocalSwarm, Placement, launch_local
from swarm.config import TimeoutConfig
from swarm.dht.reachability import Reachability, choose_reachability, use_static_relays
from swarm.errors import ConfigError
from swarm.node.config import PeerConfig
from swarmtest.configs import DATA, tiny_config
from swarmtest.records import records
from swarmtest.wanlab import PUBLIC_SUBNET, WanLab, unsupported_reason

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
        choose_reachability("nat", initial_peers=[], host_maddrs=ANY, announce_maddrs=[])  # type: ignore[arg-type]  # a wrong value, on purpose


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
        PeerConfig(reachability="nat")  # type: ignore[arg-type]  # a wrong value, on purpose
    assert PeerConfig(role="auto", reachability="client").chosen_reachability().mode == "client"


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(unsupported_reason() is not None, reason=unsupported_reason() or "")
def test_peers_behind_a_firewall_serve_and_train_in_the_wan_lab(tmp_path: Path) -> None:
    """Hosts 1 and 3 let no connection in (their SYN-ACKs are dropped): the stage server there (--reachability relay)
    reserves a slot on its initial peer, announces a /p2p-circuit address and serves stage 1; the trainer there
    (--reachability client) trains to its last step, calling both servers of stage 1 — the one behind the other
    firewall only through the relay, since neither of the two accepts a connection. The lab's addresses look public
    (``PUBLIC_SUBNET``): libp2p builds circuit addresses from a relay's public addresses only."""
    cfg = tiny_config(timeouts=TimeoutConfig(announce_period_s=1.0))
    layout = LocalSwarm(peers=4, stages=1, trainers=2, steps=60)  # several announces: every server gets listed
    with WanLab(caps_mbit=[None] * 4, prefix="slabtest-nat-", subnet=PUBLIC_SUBNET) as lab:
        for host in (1, 3):
            lab.block_inbound(host)
        where = {"stage1-0": (0, ()), "stage1-1": (1, ("--reachability", "relay"))}
        where |= {"trainer-0": (2, ()), "trainer-1": (3, ("--reachability", "client"))}
        hosts = {
            name: Placement(prefix=tuple(lab.command(i, [])), host=lab.hosts[i].address, args=args)
            for name, (i, args) in where.items()
        }
        code = launch_local(
            layout,
            out=tmp_path,
            config=cfg,
            peer=PeerConfig(data=[DATA]),
            place=hosts.__getitem__,
            echo=lambda line: None,
        )
    logs = {name: (tmp_path / f"{name}.log").read_text() for name in where}
    assert code == 0, logs["trainer-1"][-3000:]
    assert "reachability: client (as asked with --reachability)" in logs["trainer-1"]
    assert "reachability: relay (as asked with --reachability)" in logs["stage1-1"]
    assert "reachability: public" in logs["stage1-0"]
    for trainer in ("trainer-0", "trainer-1"):
        assert records(tmp_path, trainer)[-1]["step"] == layout.steps, logs[trainer][-3000:]
    behind_firewall = [r for r in records(tmp_path, "stage1-1") if r.role == "stage"]
    assert behind_firewall and "stage1-1: stage of swarm ready" in logs["stage1-1"], logs["stage1-1"][-3000:]
    (joined,) = [line for line in logs["stage1-1"].splitlines() if line.startswith(READY_PREFIX)]
    relay = f"/ip4/{lab.hosts[0].address}/tcp/"
    assert relay in joined and "/p2p-circuit/p2p/" in joined, joined  # its address: a circuit through host 0's peer
    server_id = joined.rsplit("/p2p/", 1)[1]
    links = records(tmp_path, "trainer-1")[-1]["links"]  # per server called: what the completed calls measured
    assert server_id in links and links[server_id]["bytes_per_s"] > 0, (server_id, links)
    assert behind_firewall[-1]["backward"] > 0


def test_a_peer_behind_nat_takes_its_trusted_relays_as_static_relays() -> None:
    """hivemind never turns p2pd's relay discovery off, and with it on p2pd reserves no relay slot for 3 minutes."""
    use_static_relays()
    assert "-relayDiscovery=0" in P2P._make_process_args("p2pd", autoRelay=True, trustedRelays=PUBLIC_PEER)
    assert not any(arg.startswith("-relayDiscovery") for arg in P2P._make_process_args("p2pd", autoRelay=False))
