"""The dashboard: events, series and the health verdict from snapshots, its SQLite history, Prometheus text, the HTTP
routes, the command line, and the page in a real browser on a live swarm (restarted on its history)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from hivemind.p2p import PeerID
from typer.testing import CliRunner

from peer.cli import app
from peer.dashboard.exposition import PROMETHEUS_TYPE, prometheus_text
from peer.dashboard.history import History
from peer.dashboard.server import history_path, make_handler, swarm_info, watch
from peer.dashboard.store import HistoryError, HistoryStore
from peer.launch import REPO_ROOT
from swarm.config import TimeoutConfig
from swarm.dht.records import PROTOCOL_VERSION, PeerMetrics
from swarm.events import Metrics, of_kind, read_events
from swarm.node.config import PeerConfig
from swarmtest.configs import DATA, tiny_config
from swarmtest.processes import Swarm

CFG = tiny_config(stages=2, steps=2000, timeouts=TimeoutConfig(rpc_s=10.0, announce_period_s=1.0, record_ttl_s=4.0))


def record(**fields: object) -> PeerMetrics:
    return PeerMetrics(
        **{"role": "stage", "stage": 1, "state": "serving", "step": 0, "version": PROTOCOL_VERSION, **fields}
    )


def trainer(**fields: object) -> PeerMetrics:
    return record(**{"role": "trainer", "stage": 0, "state": "training", **fields})


def test_events_are_what_changed_between_snapshots() -> None:
    history = History(leave_after_s=3.0, stalled_after_s=60.0)
    history.update({"A": record(), "T": trainer(state="joining")}, now=0.0)
    history.update({"A": record(stage=2), "T": trainer(bans=2), "B": record(state="recovering")}, now=1.0)
    history.update(
        {"A": record(stage=2, outer_round=1), "B": record(recoveries=1)}, now=2.0
    )  # T unseen for 1 s: not gone yet
    history.update({"A": record(stage=2, outer_round=1), "B": record(recoveries=1)}, now=5.0)
    assert [(e.time, e.kind, e.peer, e.text) for e in history.events] == [
        (0.0, "join", "A", "joined stage 1 (serving)"),
        (0.0, "join", "T", "joined as a trainer (joining)"),
        (1.0, "move", "A", "moved from stage 1 to stage 2"),
        (1.0, "state", "T", "joining → training"),
        (1.0, "ban", "T", "banned 2 peers (2 banned now)"),
        (1.0, "join", "B", "joined stage 1 (recovering)"),
        (2.0, "state", "B", "recovering → serving"),
        (2.0, "recovery", "B", "rebuilt stage 1 from its neighbours"),
        (5.0, "leave", "T", "left as a trainer"),
    ]
    assert set(history.peers) == {"A", "B"} and history.event_counts["join"] == 3
    assert history.state(now=5.0)["rounds"] == {
        "0": [(0.0, 0)],
        "1": [(0.0, 0)],
        "2": [(1.0, 0), (2.0, 1)],
    }  # when a stage first got there


def test_series_grow_when_a_trainer_logs_and_throughput_sums_trainers() -> None:
    history = History(leave_after_s=10.0, stalled_after_s=60.0)
    for now, step, loss, val in [
        (0.0, 0, None, None),
        (1.0, 5, 4.0, None),
        (2.0, 8, 4.0, None),
        (3.0, 10, 3.5, 3.9),
        (4.0, 12, 3.5, 3.9),
    ]:
        history.update(
            {
                "T": trainer(step=step, tokens=64 * step, train_loss=loss, val_loss=val, tokens_per_s=100.0 * now),
                "S": record(tokens_per_s=999.0),
            },
            now,
        )
    state = history.state(now=4.0)
    # (time, step, tokens, loss): the page plots loss against tokens or steps; a repeated record adds no point
    assert state["loss"] == {"T": [(1.0, 5, 320, 4.0), (3.0, 10, 640, 3.5)]}
    assert state["val_loss"] == {"T": [(3.0, 10, 640, 3.9)]}
    assert state["throughput"] == [
        (float(t), 100.0 * t) for t in range(5)
    ]  # servers' tokens are the trainers' tokens again


def test_bandwidth_is_the_byte_rate_over_the_last_polls() -> None:
    history = History(leave_after_s=10.0, stalled_after_s=60.0, rate_polls=3)
    for now, sent in [
        (0.0, 0),
        (1.0, 1000),
        (2.0, 3000),
        (3.0, 6000),
        (4.0, 500),
    ]:  # at t=4 the peer restarted: its counter went back
        history.update(
            {
                "S": record(
                    bytes_sent={"activations": sent, "gradients": 2 * sent}, bytes_received={"eval": 10 * int(now)}
                )
            },
            now,
        )
        if now == 3.0:
            peer = history.state(now)["peers"][0]
            assert peer["rate_sent"] == {
                "activations": 2500.0,
                "gradients": 5000.0,
            }  # (6000 - 1000) / 2 s: the window holds 3 polls
            assert peer["rate_received"] == {"eval": 10.0}
    assert history.state(4.0)["peers"][0]["rate_sent"] == {"activations": 250.0, "gradients": 500.0}


SAMPLE = re.compile(r'^(swarmloco_[a-z_]+)\{((?:[a-z_]+="(?:[^"\\]|\\.)*",?)*)\} (\S+)$')


def test_prometheus_text_exposes_every_peer_under_typed_families() -> None:
    history = History(leave_after_s=10.0, stalled_after_s=60.0)
    history.update(
        {
            "T": trainer(
                name="alice",
                step=3,
                tokens=6000,
                train_loss=3.5,
                tokens_per_s=1200.0,
                bytes_sent={"activations": 4096},
                dht_stores=42,
            ),
            "S": record(step=3, bans=1, bytes_received={"activations": 4096}),
        },
        now=1.0,
    )
    state = {"swarm": swarm_info(CFG), **history.state(now=1.0)}
    next(peer for peer in state["peers"] if peer["role"] == "stage")["id"] = (
        'odd "peer"\\\nid'  # whatever an id holds is escaped
    )
    text = prometheus_text(state)
    typed, samples = {}, {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            typed[name] = kind
        elif not line.startswith("# HELP "):
            name, labels, value = SAMPLE.match(line).groups()
            assert name in typed, f"{name} before its # TYPE line"
            assert labels.startswith(f'swarm="{CFG.name}",config_hash="{CFG.hash()}"'), line  # on every series
            samples[f"{name}{{{labels.split(',', 2)[2]}}}"] = float(value)
    assert typed["swarmloco_bytes_sent_total"] == "counter" and typed["swarmloco_train_loss"] == "gauge"
    assert typed["swarmloco_tokens_total"] == "counter" and "swarmloco_tokens_per_second" not in typed  # no rate gauge
    assert samples['swarmloco_tokens_total{peer="T",name="alice",role="trainer",stage="0"}'] == 6000
    assert typed["swarmloco_dht_stores_total"] == "counter"
    assert samples['swarmloco_dht_stores_total{peer="T",name="alice",role="trainer",stage="0"}'] == 42
    assert samples['swarmloco_train_loss{peer="T",name="alice",role="trainer",stage="0"}'] == 3.5
    assert (
        samples['swarmloco_bytes_sent_total{peer="T",name="alice",role="trainer",stage="0",kind="activations"}'] == 4096
    )
    assert samples['swarmloco_banned_peers{peer="odd \\"peer\\"\\\\\\nid",name="",role="stage",stage="1"}'] == 1
    assert samples['swarmloco_peers{role="stage"}'] == 1 and samples['swarmloco_events_total{kind="join"}'] == 2
    assert samples['swarmloco_health{verdict="yellow"}'] == 1 and samples['swarmloco_health{verdict="green"}'] == 0
    assert not any(
        key.startswith("swarmloco_val_loss") for key in samples
    )  # no validation yet: no sample, rather than a fake 0


@pytest.fixture
def served() -> Iterator[tuple[str, dict]]:
    """The dashboard's HTTP routes over a fixed state, on a free loopback port."""
    from http.server import ThreadingHTTPServer

    history = History(leave_after_s=10.0, stalled_after_s=60.0)
    history.update({"T": trainer(train_loss=2.5)}, now=1.0)
    state = {"swarm": swarm_info(CFG), **history.state(now=1.0)}
    server = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(lambda: state))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}", state
    server.shutdown()
    server.server_close()


def get(url: str) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.headers["Content-Type"], response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], b""


def test_routes_serve_the_page_its_assets_the_state_and_prometheus_text(served: tuple[str, dict]) -> None:
    base, state = served
    status, content_type, page = get(base + "/")
    assert (
        status == 200 and content_type.startswith("text/html") and b'src="/app.js"' in page and b"https://" not in page
    )
    assert get(base + "/app.js")[:2] == (200, "text/javascript; charset=utf-8")
    assert get(base + "/style.css")[1].startswith("text/css")
    status, content_type, body = get(base + "/api/state?t=1")
    assert status == 200 and content_type == "application/json" and json.loads(body) == json.loads(json.dumps(state))
    status, content_type, body = get(base + "/metrics")
    assert (status, content_type) == (200, PROMETHEUS_TYPE) and body.decode() == prometheus_text(state)
    for path in ("/../server.py", "/static/app.js", "/../../peer/dashboard/server.py", "/etc/passwd", "/api"):
        assert get(base + path)[0] == 404, path


def test_watch_polls_until_stopped_and_outlives_a_failed_read() -> None:
    history, peer = History(leave_after_s=10.0, stalled_after_s=60.0), PeerID(b"\x00\x24\x08\x01\x12\x20" + bytes(32))
    calls = 0

    async def read() -> tuple[dict[PeerID, PeerMetrics], dict[str, str]]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise TimeoutError("the DHT did not answer")
        if calls == 3:
            stop.set()
        return {peer: record(step=calls)}, {peer.to_base58(): "/ip4/10.0.0.7/tcp/4100"}

    stop = asyncio.Event()
    asyncio.run(asyncio.wait_for(watch(read, history, 0.01, stop), timeout=10))
    view = history.peers[peer.to_base58()]
    assert calls == 3 and view.metrics.step == 3 and view.address == "/ip4/10.0.0.7/tcp/4100"


def dashboard(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["dashboard", *args])
    return result.exit_code, result.output


def test_credentials_without_an_identity_is_a_clear_error() -> None:
    code, output = dashboard("--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/x", "--credentials", "me.cert")
    assert code == 2 and "--credentials needs --identity" in output


def test_the_command_requires_initial_peers_and_a_valid_port() -> None:
    assert dashboard()[0] == 2 and "--initial-peers" in dashboard()[1]
    assert dashboard("--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/x", "--port", "70000")[0] == 2


# ---- the health verdict


def test_health_is_green_only_while_trainers_advance() -> None:
    history = History(leave_after_s=100.0, stalled_after_s=30.0, num_stages=1)
    verdict = lambda now: (health := history.health(now)).verdict + ": " + health.reason
    assert verdict(0.0).startswith("red: no peers")
    history.update({"S": record()}, now=0.0)
    assert verdict(0.0).startswith("red: no trainer")
    history.update({"S": record(), "T": trainer(step=0)}, now=1.0)
    assert verdict(1.0).startswith("yellow: waiting to see a trainer's step advance")
    history.update({"S": record(), "T": trainer(step=5, tokens=320, tokens_per_s=64.0)}, now=2.0)
    assert verdict(2.0) == "green: training: 1 trainer(s) advancing, 64 tokens/s"
    history.update({"S": record(), "T": trainer(step=5, tokens=320)}, now=20.0)
    assert verdict(20.0).startswith("green")  # no step for 18 s: within the window
    history.update({"S": record(), "T": trainer(step=5, tokens=320)}, now=40.0)
    assert verdict(40.0) == "red: training stalled: no trainer's step advanced in the last 30 s"
    history.update({"S": record(stage=2), "T": trainer(step=6, tokens=384)}, now=41.0)  # stage 1 lost its server
    assert verdict(41.0) == "yellow: stage 1 has no server: trainers' paths skip it"


def test_health_names_joining_and_stalled_trainers() -> None:
    history = History(leave_after_s=100.0, stalled_after_s=30.0)
    history.update({"A": trainer(state="joining"), "B": trainer()}, now=0.0)
    history.update({"A": trainer(state="joining"), "B": trainer()}, now=50.0)
    assert history.health(50.0).verdict == "yellow" and "joining" in history.health(50.0).reason
    history.update({"A": trainer(state="training"), "B": trainer(step=1)}, now=51.0)
    assert (history.health(51.0).verdict, history.health(51.0).reason) == ("yellow", "1 of 2 trainers stalled")


# ---- the peers table and its labels


def test_the_peers_table_has_each_peers_name_role_stage_uptime_version_rates_bytes_and_address() -> None:
    history = History(leave_after_s=100.0, stalled_after_s=30.0)
    metrics = trainer(
        name="alice", tokens=4096, tokens_per_s=512.0, uptime_s=75.0, bytes_sent={"activations": 10}, step=4
    )
    history.update({"T": metrics}, now=1.0, addresses={"T": "/ip4/10.0.0.7/tcp/4100"})
    history.update({"T": metrics, "S": record()}, now=2.0)  # no address this poll: the last one holds
    rows = {row["id"]: row for row in history.state(now=2.0)["peers"]}
    row = rows["T"]
    assert (row["name"], row["role"], row["stage"], row["state"], row["uptime_s"], row["version"]) == (
        "alice",
        "trainer",
        0,
        "training",
        75.0,
        PROTOCOL_VERSION,
    )
    assert (row["tokens_per_s"], row["tokens"], row["bytes_sent"], row["address"]) == (
        512.0,
        4096,
        {"activations": 10},
        "/ip4/10.0.0.7/tcp/4100",
    )
    assert rows["S"]["name"] is None and rows["S"]["address"] is None
    assert history.state(now=2.0)["labels"] == {"T": "alice"}  # the loss curves' legend


# ---- history across restarts


def test_history_survives_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "history.sqlite"

    def restarted() -> History:
        return History(
            leave_after_s=3.0,
            stalled_after_s=30.0,
            max_points=3,
            store=HistoryStore.open(path, swarm_id=CFG.swarm_id),
        )

    history = restarted()
    for now in range(5):
        history.update(
            {
                "T": trainer(name="alice", step=now, tokens=64 * now, train_loss=4.0 - now / 10, val_loss=4.0),
                "S": record(),
                **({"U": trainer(name="bob")} if now == 0 else {}),
            },
            float(now),
        )
    before = history.state(now=4.0)
    history._store.close()

    history = restarted()  # the dashboard starts again: where it stopped, its series cut to max_points
    after = history.state(now=4.0)
    assert after["loss"]["T"] == before["loss"]["T"] and len(after["loss"]["T"]) == 3
    assert after["val_loss"] == {"T": [(0.0, 0, 0, 4.0)]}
    assert len(after["throughput"]) == 3 and after["rounds"] == {"0": [(0.0, 0)], "1": [(0.0, 0)]}
    assert after["events"] == before["events"] and after["event_counts"] == {"join": 3, "leave": 1}
    assert after["labels"] == {"T": "alice", "U": "bob"}  # bob left, his name stays with his curve
    assert [(peer["id"], peer["step"]) for peer in after["peers"]] == [("T", 4), ("S", 0)]
    assert history.health(4.5).verdict == "green"  # T advanced at t=4, as the last dashboard saw

    history.update({"T": trainer(name="alice", step=5, tokens=320, train_loss=3.4)}, now=9.0)
    kinds = [(event["kind"], event["peer"]) for event in history.state(now=9.0)["events"]]
    assert kinds[-1] == ("leave", "S") and ("join", "T") not in kinds[3:]  # T went on; S left while it was down
    assert HistoryStore.open(path, swarm_id=CFG.swarm_id).load(max_points=10, max_events=10).event_counts["leave"] == 2


def test_a_history_file_of_another_swarm_or_not_sqlite_is_a_clear_error(tmp_path: Path) -> None:
    HistoryStore.open(tmp_path / "a.sqlite", swarm_id="one-0123456789abcdef").close()
    with pytest.raises(HistoryError, match="holds the history of swarm one-0123456789abcdef"):
        HistoryStore.open(tmp_path / "a.sqlite", swarm_id="two-0123456789abcdef")
    (tmp_path / "notes.txt").write_text("not a database " * 100)
    with pytest.raises(HistoryError, match="not a usable SQLite file"):
        HistoryStore.open(tmp_path / "notes.txt", swarm_id="one-0123456789abcdef")
    with pytest.raises(HistoryError):
        HistoryStore.open(tmp_path / "no" / "such" / "dir.sqlite", swarm_id="one-0123456789abcdef")


def test_history_option_picks_a_file_or_memory() -> None:
    assert history_path(None, "swarmloco-0123456789abcdef") == Path(
        "swarmloco-dashboard-swarmloco-0123456789abcdef.sqlite"
    )
    assert history_path("runs/h.sqlite", "x") == Path("runs/h.sqlite")
    assert history_path("", "x") is None and history_path("none", "x") is None


# ---- the page in headless Chromium, on a live swarm

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--window-size=1440,1290",
    "--virtual-time-budget=4000",
]
TRAINER = """
import sys
from pathlib import Path
from peer.launch import run_peer
from swarm.node.config import PeerConfig
from swarm.config import TrainerOptions
initial_peer, out, data = sys.argv[1:]
peer = PeerConfig(role="trainer", initial_peers=[initial_peer], host_maddrs=["/ip4/127.0.0.1/tcp/0"], steps=100_000, data=[data],
                  out=Path(out), name="trainer-0", threads=1,
                  trainer=TrainerOptions(log_every=5, eval_every=20))  # `swarmloco run` validates only at the end
run_peer(peer)
"""


def chromium(url: str, profile: Path, *args: str) -> str:
    result = subprocess.run(
        [CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args, url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium (.ci/run installs Debian's chromium package)")
def test_the_page_shows_a_live_swarm_in_a_browser(tmp_path: Path, child_processes: list) -> None:
    swarm = Swarm(tmp_path, CFG, child_processes)
    swarm.spawn("stage1-0", PeerConfig(role="stage", stage=1))
    swarm.spawn("stage2-0", PeerConfig(role="stage", stage=2))
    initial_peer = swarm.join[1]
    swarm.spawn_command("trainer-0", [sys.executable, "-u", "-c", TRAINER, initial_peer, str(tmp_path), DATA])
    history_file = tmp_path / "history.sqlite"
    command = [sys.executable, "-m", "peer", "dashboard", "--initial-peers", initial_peer, "--port", "0"]
    command += ["--history", str(history_file)]
    dashboard_url = lambda name: re.search(r"http://127\.0\.0\.1:\d+/", swarm.log(name, 10**6))
    swarm.spawn_command("dashboard", command)
    url = swarm.wait("dashboard URL", lambda: dashboard_url("dashboard"), 60)[0]
    for name in ("stage1-0", "stage2-0", "trainer-0"):
        swarm.ready(name)
    peers = dict(swarm.ids)

    def ready() -> dict | None:
        state = get_state(url)
        loss, val = (state[series].get(peers["trainer-0"], []) for series in ("loss", "val_loss"))
        return state if {p["id"] for p in state["peers"]} == set(peers.values()) and len(loss) >= 4 and val else None

    state = swarm.wait("loss and validation points of all three peers", ready, 75)
    assert {p["id"]: (p["state"], p["name"]) for p in state["peers"]} == {
        peers["stage1-0"]: ("serving", "stage1-0"),
        peers["stage2-0"]: ("serving", "stage2-0"),
        peers["trainer-0"]: ("training", "trainer-0"),
    }  # each peer's --name, published in its record
    health = swarm.wait("a green verdict", lambda: (h := get_state(url)["health"])["verdict"] == "green" and h, 60)
    assert health["reason"].startswith("training: 1 trainer(s) advancing")

    dom = chromium(url, tmp_path / "profile", "--dump-dom")
    loss_chart = re.search(r'<svg[^>]*id="loss-chart".*?</svg>', dom, re.S)[0]
    assert (
        int(re.search(r'data-points="(\d+)"', loss_chart)[1]) >= 5 and loss_chart.count('class="pt"') >= 2
    )  # validation points, last train point
    assert loss_chart.count('class="line"') == 2  # the trainer's train and validation curves
    assert "loss against tokens" in loss_chart and ">trainer-0 train<" in dom  # x axis; the legend names the trainer
    pipeline = re.search(r'<section[^>]*id="pipeline-panel".*?</section>', dom, re.S)[0]
    table = re.search(r'<table[^>]*id="peers-table".*?</table>', dom, re.S)[0]
    for name, peer in peers.items():
        assert f'data-peer="{peer}"' in pipeline, name
        row = re.search(rf'<tr data-peer="{peer}".*?</tr>', table, re.S)[0]
        assert f'<td data-key="name" class="">{name}</td>' in row, row
    assert re.search(r'<div id="health" class="health green"', dom)
    screenshot = tmp_path / "dashboard.png"
    chromium(url, tmp_path / "profile", f"--screenshot={screenshot}")
    assert screenshot.read_bytes().startswith(b"\x89PNG") and screenshot.stat().st_size > 20_000
    if os.environ.get("SWARMLOCO_UPDATE_DOCS"):
        (REPO_ROOT / "docs").mkdir(exist_ok=True)
        shutil.copy(screenshot, REPO_ROOT / "docs" / "dashboard.png")

    # what each server published is, to the byte, a line of its JSONL log
    for name in ("stage1-0", "stage2-0"):
        published = {
            k: v
            for k, v in next(p for p in state["peers"] if p["id"] == peers[name]).items()
            if k in PeerMetrics.__fields__
        }
        logged = [e.metrics for e in of_kind(read_events(tmp_path / f"{name}.jsonl"), Metrics)]
        assert published in logged, name

    # a restarted dashboard starts from its history: the curves it had, no second join
    swarm.procs["dashboard"].send_signal(signal.SIGINT)
    swarm.procs["dashboard"].wait(timeout=30)
    shown = get_state.last
    swarm.spawn_command("dashboard-2", command)
    url = swarm.wait("restarted dashboard URL", lambda: dashboard_url("dashboard-2"), 60)[0]
    again = get_state(url)
    trainer_id = peers["trainer-0"]
    assert again["loss"][trainer_id][: len(shown["loss"][trainer_id])] == shown["loss"][trainer_id]
    assert again["val_loss"][trainer_id][: len(shown["val_loss"][trainer_id])] == shown["val_loss"][trainer_id]
    assert [e for e in again["events"] if e["kind"] == "join"] == [e for e in shown["events"] if e["kind"] == "join"]


def get_state(url: str) -> dict:
    """The dashboard's /api/state; the last one read is ``get_state.last``."""
    get_state.last = json.loads(urllib.request.urlopen(url + "api/state", timeout=10).read())
    return get_state.last
