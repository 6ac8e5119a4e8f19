"""Backward probes (swarm/pipeline/probing.py): a returned input gradient judged by the server's own forward, at real
shapes, through the int8 wire both ways; and when probes condemn."""

from __future__ import annotations

import pytest
import torch

from peer.data import load_corpus
from swarm.model.stages import EDGE_STAGE, build_stage
from swarm.model.step import head_loss_gradients, stage_forward, stage_gradients
from swarm.pipeline.boundary import boundary_codecs
from swarm.pipeline.probing import BackwardProbes, ProbeRule, descent, passes, probe_steps, resolved
from swarmtest.configs import DATA, tiny_config


@pytest.mark.timeout(300)
def test_at_real_shapes_an_honest_gradient_descends_and_flipped_scaled_or_random_ones_fail() -> None:
    """8 × 1024 tokens at d_model 768 (2 layers), int8 activations and gradients on the wire (measured: honest 0.89,
    flipped −0.89, ×5 0.18, random 0.0; 0.99 after 10 inner steps)."""
    torch.manual_seed(0)
    cfg = tiny_config(stages=1, model={"d_model": 768, "n_layers": 2, "n_heads": 12, "max_seq_len": 1024})
    edge, middle = build_stage(cfg.model, 1, EDGE_STAGE), build_stage(cfg.model, 1, 1)
    act, grad = boundary_codecs(cfg)
    assert (act.name, grad.name) == ("int8", "int8")
    wire_a, wire_g = (lambda t: act.decode(act.encode(t))), (lambda t: grad.decode(grad.encode(t)))
    (inputs, targets), *_ = load_corpus([DATA]).val_batches(num_sequences=8, batch_size=8, seq_len=1024)
    with torch.no_grad():
        x = wire_a(edge.embed(inputs))  # (8, 1024, 768), as the server received it
        y = stage_forward(middle, x)
    _, u, _ = head_loss_gradients(edge, wire_a(y), targets, inner_batch=8)
    u = wire_g(u)  # the gradient the trainer sent
    g_true, _ = stage_gradients(middle, x, u)
    rule = ProbeRule()
    judged = {}
    for name, g in {
        "honest": wire_g(g_true),
        "flipped": wire_g(-g_true),
        "x5": wire_g(5 * g_true),
        "random": wire_g(torch.randn_like(g_true) * g_true.std()),
    }.items():
        eps = probe_steps(x, g, rule.step)
        with torch.no_grad():  # the server's own forwards at x ± εg, through the wire
            y_plus, y_minus = (wire_a(stage_forward(middle, wire_a(x + s * eps * g))) for s in (1.0, -1.0))
        judged[name] = descent(u, y_plus, y_minus, eps, g)
    print({k: round(v, 3) for k, v in judged.items()})
    assert judged["honest"] > 0.8 and passes(judged["honest"], rule)
    assert judged["flipped"] < -0.8 and abs(judged["random"]) < 0.05 and judged["x5"] < rule.min_descent
    assert not any(passes(judged[k], rule) for k in ("flipped", "x5", "random"))


def test_a_server_is_condemned_at_its_second_failure_in_its_window_and_probed_while_one_is_there() -> None:
    probes = BackwardProbes(ProbeRule(rate=0.0, first_probes=1, failures=2, window=4))
    assert probes.should_probe("a")  # until it passed its first probe
    assert not probes.record("a", 0.95) and not probes.should_probe("a")  # passed: rate 0 from now on
    assert not probes.record("a", -0.9) and probes.should_probe("a")  # one failure: every backward probed
    for _ in range(3):
        assert not probes.record("a", 0.9)  # the failure leaves the window of 4 after four outcomes
    assert not probes.record("a", -0.9) and probes.should_probe("b")  # another server: its own first probe
    assert probes.record("a", -0.9)  # two failures in the window: condemned
    assert not probes.record("a", 1.0)  # judged: the window starts again
    assert passes(float("nan"), ProbeRule())  # a zero gradient: nothing to judge


def test_probe_rules_are_validated() -> None:
    with pytest.raises(ValueError, match="failures"):
        ProbeRule(failures=9, window=8)
    with pytest.raises(ValueError):
        ProbeRule(min_descent=0.0)


def test_a_probe_the_replies_rounding_swallowed_judges_nothing_and_the_next_steps_further() -> None:
    rule = ProbeRule(step=0.05, max_step=0.4)  # (the default cap is 0.2)
    probes = BackwardProbes(rule)
    y = torch.randn(2, 4, 8)
    assert resolved(y, y.clone()) == 0.0 and resolved(y, y + 1e-3) == 1.0
    steps = []
    for _ in range(4):  # 0.05 → 0.2 → 0.4 (the cap) → at the cap: counted as passed
        steps.append(probes.step("s"))
        probes.unresolved("s")
    assert steps == [0.05, 0.2, 0.4, 0.4] and probes.passed["s"] == 2 and probes.failed["s"] == 0


def test_a_server_answers_a_probe_on_the_weights_its_forward_ran_on_after_stepping_and_refuses_once_they_are_gone() -> (
    None
):
    """The forward reply says which weights it ran on; a forward asking for them (``Forward.on_epoch``/``on_step``)
    runs on the stashed copy after the server stepped, so a probe judges the gradient where the backward took it.
    Without that, one inner step between the backward and the probe failed honest servers (docs/architecture.md)."""
    import asyncio

    from swarm.pipeline.protocol import Backward, Forward, RemoteError, parse_reply
    from swarm.pipeline.protocol import _reply as encoded_reply
    from swarm.pipeline.server import StageServer
    from swarm.rpc.servicer import RequestError
    from swarmtest.configs import BATCH, SEQ

    torch.manual_seed(0)
    cfg = tiny_config(stages=1, train={"microbatch_size": BATCH, "inner_batch": BATCH})  # a step every backward
    server = StageServer(cfg, 1)
    act, grad = boundary_codecs(cfg)
    x = act.encode(torch.randn(BATCH, SEQ, cfg.model.d_model))

    async def run() -> None:
        first = parse_reply(encoded_reply(await server.forward("t", Forward(mb="mb0", stage=1, prev_stage=0, x=x))))
        assert first.weights == (0, 0)  # what it ran on, said in the reply (through the wire format)
        dy = grad.encode(torch.randn(BATCH, SEQ, cfg.model.d_model))
        await server.backward("t", Backward(mb="mb0", stage=1, grad=dy))
        assert server.inner_steps == 1  # stepped: its current weights are no longer those
        now = await server.forward("t", Forward(mb="mb1", stage=1, prev_stage=0, x=x))
        probe = await server.forward("t", Forward(mb="mb2", stage=1, prev_stage=0, x=x, on_epoch=0, on_step=0))
        assert probe.weights == (0, 0) and now.weights == (0, 1)
        y0, y_now, y_probe = (act.decode(bytes(r)) for r in (first, now, probe))
        assert torch.equal(y_probe, y0) and not torch.equal(y_now, y0)
        try:
            await server.forward("t", Forward(mb="mb3", stage=1, prev_stage=0, x=x, on_epoch=0, on_step=7))
        except RemoteError as e:
            raise AssertionError("a server error, not a remote one") from e
        except RequestError as e:
            assert e.code == RequestError.GONE and "no longer held" in e.message  # no strike against the trainer
        else:
            raise AssertionError("weights it never had must be refused")

    try:
        asyncio.run(run())
    finally:
        server.shutdown()
