"""The dashboard: events and series from snapshots, Prometheus text, the HTTP routes, and the page in a real browser on a live swarm."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from hivemind.p2p import PeerID
from swarm_harness import DATA, Swarm, tiny_config

from peer.launch import REPO_ROOT
from scripts.dashboard import PROMETHEUS_TYPE, History, main, make_handler, prometheus_text, swarm_info, watch
from swarm.config import TimeoutConfig
from swarm.dht.records import PROTOCOL_VERSION, PeerMetrics

CFG = tiny_config(stages=2, steps=2000, timeouts=TimeoutConfig(rpc_s=10.0, announce_period_s=1.0, record_ttl_s=4.0))


def record(**fields: object) -> PeerMetrics:
    return PeerMetrics(
        **{"role": "stage", "stage": 1, "state": "serving", "step": 0, "version": PROTOCOL_VERSION, **fields}
    )


def trainer(**fields: object) -> PeerMetrics:
    return record(**{"role": "trainer", "stage": 0, "state": "training", **fields})


def test_events_are_what_changed_between_snapshots() -> None:
    history = History(leave_after_s=3.0)
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
    history = History(leave_after_s=10.0)
    for now, step, loss, val in [
        (0.0, 0, None, None),
        (1.0, 5, 4.0, None),
        (2.0, 8, 4.0, None),
        (3.0, 10, 3.5, 3.9),
        (4.0, 12, 3.5, 3.9),
    ]:
        history.update(
            {
                "T": trainer(step=step, train_loss=loss, val_loss=val, tokens_per_s=100.0 * now),
                "S": record(tokens_per_s=999.0),
            },
            now,
        )
    state = history.state(now=4.0)
    assert state["loss"] == {"T": [(1.0, 5, 4.0), (3.0, 10, 3.5)]}  # a repeated record adds no point
    assert state["val_loss"] == {"T": [(3.0, 10, 3.9)]}
    assert state["throughput"] == [
        (float(t), 100.0 * t) for t in range(5)
    ]  # servers' tokens are the trainers' tokens again


def test_bandwidth_is_the_byte_rate_over_the_last_polls() -> None:
    history = History(leave_after_s=10.0, rate_polls=3)
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


SAMPLE = re.compile(r'^(swarmloco_[a-z_]+)\{((?:[a-z]+="(?:[^"\\]|\\.)*",?)*)\} (\S+)$')


def test_prometheus_text_exposes_every_peer_under_typed_families() -> None:
    history = History(leave_after_s=10.0)
    history.update(
        {
            "T": trainer(step=3, train_loss=3.5, tokens_per_s=1200.0, bytes_sent={"activations": 4096}),
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
            samples[f"{name}{{{labels}}}"] = float(value)
    assert typed["swarmloco_bytes_sent_total"] == "counter" and typed["swarmloco_train_loss"] == "gauge"
    assert samples['swarmloco_train_loss{peer="T",role="trainer",stage="0"}'] == 3.5
    assert samples['swarmloco_bytes_sent_total{peer="T",role="trainer",stage="0",kind="activations"}'] == 4096
    assert samples['swarmloco_banned_peers{peer="odd \\"peer\\"\\\\\\nid",role="stage",stage="1"}'] == 1
    assert samples['swarmloco_peers{role="stage"}'] == 1 and samples['swarmloco_events_total{kind="join"}'] == 2
    assert not any(
        key.startswith("swarmloco_val_loss") for key in samples
    )  # no validation yet: no sample, rather than a fake 0


@pytest.fixture
def served() -> Iterator[tuple[str, dict]]:
    """The dashboard's HTTP routes over a fixed state, on a free loopback port."""
    from http.server import ThreadingHTTPServer

    history = History(leave_after_s=10.0)
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
    for path in ("/../scripts/dashboard.py", "/dashboard_static/app.js", "/etc/passwd", "/api"):
        assert get(base + path)[0] == 404, path


def test_watch_polls_until_stopped_and_outlives_a_failed_read() -> None:
    history, peer = History(leave_after_s=10.0), PeerID(b"\x00\x24\x08\x01\x12\x20" + bytes(32))
    calls = 0

    async def read() -> dict[PeerID, PeerMetrics]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise TimeoutError("the DHT did not answer")
        if calls == 3:
            stop.set()
        return {peer: record(step=calls)}

    stop = asyncio.Event()
    asyncio.run(asyncio.wait_for(watch(read, history, 0.01, stop), timeout=10))
    assert calls == 3 and history.peers[peer.to_base58()].metrics.step == 3


def test_credentials_without_an_identity_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/x", "--credentials", "me.cert"])
    assert exit_info.value.code == 2 and "--credentials needs --identity" in capsys.readouterr().err


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
    "--window-size=1440,1150",
    "--virtual-time-budget=4000",
]
TRAINER = """
import sys
from pathlib import Path
from peer.launch import run_peer
from swarm.peer_config import PeerConfig
from swarm.pipeline.trainer import TrainerOptions
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
    swarm.spawn("stage1-0", "--role", "stage", "--stage", "1")
    swarm.spawn("stage2-0", "--role", "stage", "--stage", "2")
    initial_peer = swarm.join[1]
    swarm.spawn_command("trainer-0", [sys.executable, "-u", "-c", TRAINER, initial_peer, str(tmp_path), DATA])
    swarm.spawn_command(
        "dashboard", [sys.executable, "scripts/dashboard.py", "--initial-peers", initial_peer, "--port", "0"]
    )

    url = swarm.wait(
        "dashboard URL", lambda: re.search(r"http://127\.0\.0\.1:\d+/", swarm.log("dashboard", 10**6)), 60
    )[0]
    for name in ("stage1-0", "stage2-0", "trainer-0"):
        swarm.ready(name)
    peers = dict(swarm.ids)

    def ready() -> dict | None:
        state = json.loads(urllib.request.urlopen(url + "api/state", timeout=10).read())
        loss, val = (state[series].get(peers["trainer-0"], []) for series in ("loss", "val_loss"))
        return state if {p["id"] for p in state["peers"]} == set(peers.values()) and len(loss) >= 4 and val else None

    state = swarm.wait("loss and validation points of all three peers", ready, 75)
    assert {p["id"]: p["state"] for p in state["peers"]} == {
        peers["stage1-0"]: "serving",
        peers["stage2-0"]: "serving",
        peers["trainer-0"]: "training",
    }

    dom = chromium(url, tmp_path / "profile", "--dump-dom")
    loss_chart = re.search(r'<svg[^>]*id="loss-chart".*?</svg>', dom, re.S)[0]
    assert (
        int(re.search(r'data-points="(\d+)"', loss_chart)[1]) >= 5 and loss_chart.count('class="pt"') >= 2
    )  # validation points, last train point
    assert loss_chart.count('class="line"') == 2  # the trainer's train and validation curves
    pipeline = re.search(r'<section[^>]*id="pipeline-panel".*?</section>', dom, re.S)[0]
    for name, peer in peers.items():
        assert f'data-peer="{peer}"' in pipeline, name
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
        logged = [json.loads(line).get("metrics") for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
        assert published in logged, name
