"""Outer optimizers: golden numbers for the outer-step math, group agreement, joins, bad payloads."""

from __future__ import annotations

import io
import logging
import random
import tracemalloc

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from compress.codecs import get_codec
from compress.config import CodecConfig
from compress.sparseloco import SparseLoCoCodec, SparseLoCoState, SparseTensor
from compress.wire import CodecId, decode_frame, encode_frame
from optim.config import OuterOptimConfig
from optim.factory import build_outer_optimizer
from optim.outer import DiLoCo, NamedTensors, OuterOptimizer, SparseLoCo
from optim.payload import max_payload_bytes, pack_payload, unpack_payload
from swarmtest.attacks import bomb_frame


def params(**values: list[float]) -> dict[str, torch.Tensor]:
    return {name: torch.tensor(v, dtype=torch.float32) for name, v in values.items()}


def minus(a: NamedTensors, b: NamedTensors) -> dict[str, torch.Tensor]:
    return {name: a[name] - b[name] for name in a}


def run_round(
    opts: list[OuterOptimizer], locals_: list[NamedTensors], shuffle: random.Random | None = None
) -> list[int]:
    """One outer step of the whole group; optionally each member receives the payloads in its own order."""
    payloads = [opt.make_payload(local) for opt, local in zip(opts, locals_)]
    used = []
    for opt, local in zip(opts, locals_):
        received = list(payloads)
        if shuffle is not None:
            shuffle.shuffle(received)
        used.append(opt.apply(received, local).used)
    return used


class RegistryCodec:
    """Stands in for SparseLoCoCodec: sends Δ's non-zeros exactly, so the test sees only the outer math."""

    def __init__(self) -> None:
        self.sent: list[SparseTensor] = []

    def new_state(self) -> SparseLoCoState:
        return SparseLoCoState()

    def encode(self, name: str, delta: torch.Tensor, state: SparseLoCoState) -> bytes:
        indices = delta.flatten().nonzero().flatten()
        self.sent.append(
            SparseTensor(indices=indices, values=delta.flatten()[indices].float(), shape=tuple(delta.shape))
        )
        return str(len(self.sent) - 1).encode()

    def decode(self, data: bytes, *, expected_shape: tuple[int, ...]) -> SparseTensor:
        sent = self.sent[int(data)]
        assert sent.shape == expected_shape
        return sent


# --- DiLoCo ---------------------------------------------------------------------------------


def test_diloco_golden_two_replicas_two_rounds() -> None:
    start = params(w=[1.0, 2.0])
    opts = [DiLoCo(start, lr=0.7, momentum=0.9, codec=get_codec("fp32")) for _ in range(2)]

    # Round 1: Δ_A = [1, 0], Δ_B = [0, -1] → mean g = [0.5, -0.5]; buf = g;
    # Nesterov update g + 0.9·buf = [0.95, -0.95]; θ = [1, 2] − 0.7·update = [0.335, 2.665].
    locals_ = [minus(start, params(w=[1.0, 0.0])), minus(start, params(w=[0.0, -1.0]))]
    assert run_round(opts, locals_) == [2, 2]
    for opt, local in zip(opts, locals_):
        torch.testing.assert_close(opt.global_params["w"], torch.tensor([0.335, 2.665]))
        assert torch.equal(local["w"], opt.global_params["w"])

    # Round 2: Δ_A = [0.2, 0.3], Δ_B = [0.2, 0] (within the pair's ×2 bound) → g = [0.2, 0.15];
    # buf = 0.9·[0.5, -0.5] + g = [0.65, -0.3]; update = g + 0.9·buf = [0.785, -0.12];
    # θ = [0.335, 2.665] − 0.7·update = [-0.2145, 2.749].
    locals_ = [minus(locals_[0], params(w=[0.2, 0.3])), minus(locals_[1], params(w=[0.2, 0.0]))]
    run_round(opts, locals_)
    for opt in opts:
        torch.testing.assert_close(opt.global_params["w"], torch.tensor([-0.2145, 2.749]))
        assert opt.round == 2


def test_group_of_one_without_momentum_adopts_local_params() -> None:
    torch.manual_seed(0)
    local = {"w": torch.randn(4, 3), "b": torch.randn(3)}
    opt = DiLoCo(local, lr=1.0, momentum=0.0, codec=get_codec("fp32"))
    trained = {name: t + torch.randn_like(t) for name, t in local.items()}
    local = {name: t.clone() for name, t in trained.items()}
    assert opt.step(local, lambda payload: [payload]).used == 1
    for name in trained:
        torch.testing.assert_close(opt.global_params[name], trained[name])
        torch.testing.assert_close(local[name], trained[name])


@pytest.mark.parametrize("codec", ["fp32", "fp16", "bf16"])
def test_replicas_agree_whatever_the_delivery_order(codec: str) -> None:
    torch.manual_seed(1)
    start = {"w": torch.randn(8, 5), "b": torch.randn(5)}
    opts = [DiLoCo(start, codec=get_codec(codec)) for _ in range(3)]
    locals_ = [{name: t.clone() for name, t in start.items()} for _ in range(3)]
    shuffle = random.Random(0)
    for _ in range(3):
        for local in locals_:  # the inner steps, different on every replica
            for t in local.values():
                t.add_(0.1 * torch.randn_like(t))
        run_round(opts, locals_, shuffle)
        for opt, local in zip(opts[1:], locals_[1:]):
            for name in start:
                assert torch.equal(opt.global_params[name], opts[0].global_params[name])
                assert torch.equal(local[name], opts[0].global_params[name])


@settings(deadline=None, max_examples=40)
@given(
    deltas=st.lists(st.lists(st.floats(-1e3, 1e3, width=32), min_size=3, max_size=3), min_size=1, max_size=5),
    seed=st.integers(0, 2**16),
)
def test_diloco_aggregate_ignores_payload_order(deltas: list[list[float]], seed: int) -> None:
    start = params(w=[0.5, -1.0, 2.0])
    payloads = [DiLoCo(start, codec=get_codec("fp32")).make_payload(minus(start, params(w=d))) for d in deltas]
    shuffled = list(payloads)
    random.Random(seed).shuffle(shuffled)
    results = []
    for order in (payloads, shuffled):
        opt, local = DiLoCo(start, codec=get_codec("fp32")), params(w=[0.0, 0.0, 0.0])
        opt.apply(order, local)
        results.append(local["w"])
    assert torch.equal(results[0], results[1])


def test_inner_state_stays_local_and_params_are_updated_in_place() -> None:
    torch.manual_seed(2)
    model = torch.nn.Linear(4, 2)
    inner = torch.optim.AdamW(model.parameters(), lr=0.1)
    opt = DiLoCo(dict(model.named_parameters()), codec=get_codec("fp32"))
    model(torch.randn(3, 4)).sum().backward()
    inner.step()
    moments = {k: v.clone() for k, v in inner.state[model.weight].items()}
    opt.step(dict(model.named_parameters()), lambda payload: [payload])
    assert torch.equal(model.weight, opt.global_params["weight"])  # the inner optimizer's own tensor moved
    for k, v in moments.items():
        assert torch.equal(inner.state[model.weight][k], v)


# --- SparseLoCo -----------------------------------------------------------------------------


def test_sparseloco_golden_per_index_mean() -> None:
    start = params(w=[1.0, 1.0, 1.0, 1.0])
    codec = RegistryCodec()
    opts = [SparseLoCo(start, lr=1.0, codec=codec) for _ in range(2)]
    # Index 0 sent by both (mean 2), index 1 by B only (2), index 2 by A only (2), index 3 by nobody (norms √5 and
    # √13: within the pair's ×2 bound).
    locals_ = [minus(start, params(w=[1.0, 0.0, 2.0, 0.0])), minus(start, params(w=[3.0, 2.0, 0.0, 0.0]))]
    assert run_round(opts, locals_) == [2, 2]
    for opt in opts:
        torch.testing.assert_close(opt.global_params["w"], torch.tensor([-1.0, -1.0, -1.0, 1.0]))


def test_sparseloco_real_codec_matches_manual_mean() -> None:
    torch.manual_seed(3)
    start = {"w": torch.randn(64, 64), "b": torch.randn(100)}
    codec = SparseLoCoCodec(topk=16)
    opts = [SparseLoCo(start, codec=codec) for _ in range(2)]
    deltas = [{name: torch.randn_like(t) for name, t in start.items()} for _ in range(2)]
    locals_ = [minus(start, d) for d in deltas]
    run_round(opts, locals_)
    for name, t in start.items():
        # What each replica sent in its first round: its Δ through a fresh error buffer.
        sent = [codec.decode(codec.encode(name, d[name], codec.new_state())) for d in deltas]
        total, count = torch.zeros(t.numel()), torch.zeros(t.numel())
        for part in sent:
            for i, v in zip(part.indices.tolist(), part.values.tolist()):
                total[i] += v
                count[i] += 1
        expected = t - (total / count.clamp(min=1)).view_as(t)
        for opt in opts:
            torch.testing.assert_close(opt.global_params[name], expected)


def test_sparseloco_error_feedback_sends_the_residual_later() -> None:
    torch.manual_seed(4)
    start = {"w": torch.randn(64, 64)}
    opt = SparseLoCo(start, codec=SparseLoCoCodec(topk=8))
    local = minus(start, {"w": torch.randn(64, 64)})
    opt.step(local, lambda payload: [payload])
    before = opt.global_params["w"].clone()
    opt.step(local, lambda payload: [payload])  # Δ = 0 now, but the error buffer still holds most of round 1
    assert not torch.equal(opt.global_params["w"], before)

    opt.load_state_dict(opt.state_dict())  # adopting a state starts the error buffer at zero
    before = opt.global_params["w"].clone()
    opt.step(local, lambda payload: [payload])
    assert torch.equal(opt.global_params["w"], before)


# --- a replica alone in its round ----------------------------------------------------------


@pytest.mark.parametrize("method", ["diloco", "sparseloco"])
def test_a_lone_round_keeps_every_bit_of_the_replicas_progress(method: str) -> None:
    torch.manual_seed(5)
    start = {"w": torch.randn(64, 64), "b": torch.randn(64)}
    opt = build_outer_optimizer(
        start,
        OuterOptimConfig(method=method),
        CodecConfig(pseudo_gradients="sparseloco" if method == "sparseloco" else "fp32"),
    )
    for round_ in (1, 2):  # twice: the second round starts from the first's global weights
        local = {name: t + 0.1 * torch.randn(t.shape) for name, t in start.items()}
        trained = {name: t.clone() for name, t in local.items()}
        opt.make_payload(local)  # made before the round knew it would be alone
        opt.apply_alone(local)
        assert opt.round == round_
        assert all(torch.equal(local[n], trained[n]) and torch.equal(opt.global_params[n], trained[n]) for n in start)
        start = trained
    if method == "sparseloco":
        assert opt._error.errors == {}  # nothing was folded into the error buffer: nothing to send twice later
    else:
        assert opt.optimizer.state_dict()["state"] == {}  # no momentum from the replica's own Δ


def test_sparseloco_lone_or_empty_rounds_leave_the_error_buffer_as_the_group_left_it() -> None:
    torch.manual_seed(6)
    start = {"w": torch.randn(64, 64)}
    a, b = (SparseLoCo(start, codec=SparseLoCoCodec(topk=8)) for _ in range(2))
    la, lb = ({"w": start["w"] + torch.randn(64, 64)} for _ in range(2))
    run_round([a, b], [la, lb])  # a group round: most of each Δ stays in the error buffers
    after_group = {n: e.clone() for n, e in a._error.errors.items()}
    la["w"] += torch.randn(64, 64)
    a.make_payload(la)
    a.apply_alone(la)
    a.make_payload(la)
    a.apply([b"junk"], la)  # a round with no usable payload
    assert all(torch.equal(a._error.errors[n], after_group[n]) for n in after_group)


# --- joining, bad payloads, config ----------------------------------------------------------


@pytest.mark.parametrize("method", ["diloco", "sparseloco"])
def test_late_joiner_adopts_the_global_state(method: str) -> None:
    torch.manual_seed(5)
    cfg, codecs = (
        OuterOptimConfig(method=method),
        CodecConfig(pseudo_gradients="fp16" if method == "diloco" else "sparseloco"),
    )
    start = {"w": torch.randn(64, 64), "b": torch.randn(64)}
    opts = [build_outer_optimizer(start, cfg, codecs) for _ in range(2)]
    locals_ = [{name: t.clone() for name, t in start.items()} for _ in range(2)]
    for _ in range(2):
        for local in locals_:
            local["w"].add_(0.1 * torch.randn(64, 64))
        run_round(opts, locals_)

    newcomer_local = {name: torch.randn_like(t) for name, t in start.items()}
    newcomer = build_outer_optimizer(newcomer_local, cfg, codecs)
    buffer = io.BytesIO()  # the state travels as bytes, as in a download
    torch.save(opts[0].state_dict(), buffer)
    newcomer.load_state_dict(torch.load(io.BytesIO(buffer.getvalue())))
    newcomer.copy_global_to(newcomer_local)
    assert newcomer.round == 2

    opts, locals_ = opts + [newcomer], locals_ + [newcomer_local]
    for local in locals_:
        local["w"].add_(0.1 * torch.randn(64, 64))
    assert run_round(opts, locals_) == [3, 3, 3]
    for opt in opts[1:]:
        for name in start:
            assert torch.equal(opt.global_params[name], opts[0].global_params[name])
        if method == "diloco":
            buf, ref = opt.optimizer.state_dict()["state"], opts[0].optimizer.state_dict()["state"]
            assert all(torch.equal(buf[i]["momentum_buffer"], ref[i]["momentum_buffer"]) for i in ref)


class NaNSparseLoCoCodec(SparseLoCoCodec):
    """Sends well-formed frames (valid checksum) whose last value scale is NaN."""

    def encode(self, name: str, delta: torch.Tensor, state: SparseLoCoState) -> bytes:
        frame = decode_frame(super().encode(name, delta, state))
        return encode_frame(
            frame.codec_id, frame.body[:-2] + b"\xc0\x7f", dtype=frame.dtype, shape=frame.shape, meta=frame.meta
        )


def _bad_payload(bad: str, method: str, start: dict[str, torch.Tensor]) -> bytes:
    codec = get_codec("fp32") if method == "diloco" else SparseLoCoCodec()
    make = (lambda ps: DiLoCo(ps, codec=codec)) if method == "diloco" else (lambda ps: SparseLoCo(ps, codec=codec))
    step = {name: t - 1.0 for name, t in start.items()}
    if bad in ("garbage", "truncated"):
        return b"\x00" * 40 if bad == "garbage" else make(start).make_payload(step)[:-3]
    if bad == "wrong_round":
        late = make(start)
        late.round = 7
        return late.make_payload(step)
    if bad == "non_finite" and method == "diloco":
        return make(start).make_payload({name: torch.full_like(t, float("nan")) for name, t in start.items()})
    if bad == "non_finite":
        return SparseLoCo(start, codec=NaNSparseLoCoCodec()).make_payload(step)
    other = (
        {name: torch.zeros(t.numel() + 1) for name, t in start.items()}
        if bad == "wrong_shape"
        else {"other": start["w"]}
    )
    return make(other).make_payload(other)


@pytest.mark.parametrize("bad", ["garbage", "truncated", "wrong_shape", "wrong_names", "non_finite", "wrong_round"])
@pytest.mark.parametrize("method", ["diloco", "sparseloco"])
def test_bad_payload_is_dropped_with_a_warning(method: str, bad: str, caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(6)
    cfg, codecs = (
        OuterOptimConfig(method=method),
        CodecConfig(pseudo_gradients="fp32" if method == "diloco" else "sparseloco"),
    )
    start = {"w": torch.randn(64, 64)}
    clean, dirty = build_outer_optimizer(start, cfg, codecs), build_outer_optimizer(start, cfg, codecs)
    payloads = [clean.make_payload(minus(start, {"w": torch.randn(64, 64)})) for _ in range(2)]
    clean.apply(payloads, {"w": start["w"].clone()})
    with caplog.at_level(logging.WARNING, logger="optim.outer"):
        screening = dirty.apply(payloads + [_bad_payload(bad, method, start)], {"w": start["w"].clone()})
    assert screening.used == 2 and list(screening.dropped) == [2]  # the bad one, by its index
    assert "dropped" in caplog.text
    assert torch.equal(dirty.global_params["w"], clean.global_params["w"])


@pytest.mark.parametrize("method", ["diloco", "sparseloco"])
def test_a_frame_declaring_a_huge_shape_is_refused_from_its_header_in_bounded_memory(
    method: str, caplog: pytest.LogCaptureFixture
) -> None:
    torch.manual_seed(6)
    cfg, codecs = (
        OuterOptimConfig(method=method),
        CodecConfig(pseudo_gradients="fp32" if method == "diloco" else "sparseloco"),
    )
    start = {"w": torch.randn(64, 64)}
    clean, dirty = build_outer_optimizer(start, cfg, codecs), build_outer_optimizer(start, cfg, codecs)
    payloads = [clean.make_payload(minus(start, {"w": torch.randn(64, 64)})) for _ in range(2)]
    round_, frames = unpack_payload(payloads[0], max_bytes=max_payload_bytes(start))
    if method == "sparseloco":  # (1, 64M): 18 KB on the wire, 3.4 GB to decode, said issue 20
        shape = (1, 64 << 20)
        bomb = bomb_frame(
            CodecId.SPARSELOCO, shape, decode_frame(frames["w"]).meta, clean.codec.limits_for(shape).max_body_bytes
        )
    else:  # a 64 MiB fp32 body, within the default limits of a receiver that would not know the shape
        shape = (4096, 4096)
        bomb = bomb_frame(CodecId.FP32, shape, b"", 4 * (4096 * 4096))
    hostile = pack_payload(round_, {"w": bomb})
    assert len(hostile) < 32 << 10
    clean.apply(payloads, {"w": start["w"].clone()})
    tracemalloc.start()
    try:
        with caplog.at_level(logging.WARNING, logger="optim.outer"):
            assert dirty.apply([*payloads, hostile], {"w": start["w"].clone()}).used == 2
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert f"frame declares shape {shape}, the receiver expects (64, 64)" in caplog.text
    assert peak < 4 << 20  # decoding the bomb would hold its whole body: 64 MiB or more
    assert torch.equal(dirty.global_params["w"], clean.global_params["w"])


def test_a_payload_declaring_a_body_over_the_stages_bound_is_refused_before_decompressing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    start = {"w": torch.randn(64, 64)}
    clean, dirty = (build_outer_optimizer(start, OuterOptimConfig(), CodecConfig()) for _ in range(2))
    payloads = [clean.make_payload(minus(start, {"w": torch.randn(64, 64)})) for _ in range(2)]
    bound = max_payload_bytes(start)  # 8 bytes per parameter and 1 MiB
    hostile = bomb_frame(CodecId.OUTER_PAYLOAD, (16,), b"", bound + 1)  # its shape field lies
    assert len(hostile) < 4 << 10
    clean.apply(payloads, {"w": start["w"].clone()})
    with caplog.at_level(logging.WARNING, logger="optim.outer"):
        assert dirty.apply([*payloads, hostile], {"w": start["w"].clone()}).dropped.keys() == {2}
    assert f"body of {bound + 1} bytes is over the limit of {bound}" in caplog.text
    assert torch.equal(dirty.global_params["w"], clean.global_params["w"])


def test_a_payload_codes_its_parameters_names_and_frame_headers_as_one_stream() -> None:
    torch.manual_seed(0)
    stage = {f"blocks.{i}.{kind}.weight": torch.randn(64, 64) for i in range(4) for kind in ("attn", "ffn", "out")}
    opt = build_outer_optimizer(stage, OuterOptimConfig(), CodecConfig())
    payload = opt.make_payload({name: w - 1e-3 * torch.randn(64, 64) ** 3 for name, w in stage.items()})
    round_, frames = unpack_payload(payload, max_bytes=max_payload_bytes(stage))
    # one frame per parameter would send every name, entry and frame header apart
    assert round_ == 0 and list(frames) == list(stage)
    apart = sum(len(name) + len(frame) + 6 for name, frame in frames.items()) + 12
    assert len(payload) < 0.9 * apart, (len(payload), apart)


def test_no_usable_payload_leaves_everything_in_place(caplog: pytest.LogCaptureFixture) -> None:
    start = params(w=[1.0, 2.0])
    opt, local = DiLoCo(start, codec=get_codec("fp32")), params(w=[3.0, 4.0])
    with caplog.at_level(logging.WARNING, logger="optim.outer"):
        assert opt.apply([b"junk"], local).used == 0
    assert torch.equal(opt.global_params["w"], start["w"]) and torch.equal(local["w"], torch.tensor([3.0, 4.0]))
    assert opt.round == 1


def test_local_params_must_match_by_name() -> None:
    opt = DiLoCo(params(w=[1.0]), codec=get_codec("fp32"))
    with pytest.raises(KeyError, match="missing"):
        opt.make_payload(params(v=[1.0]))


def test_build_outer_optimizer_follows_the_config() -> None:
    start = params(w=[1.0])
    assert build_outer_optimizer(start, OuterOptimConfig(method="none"), CodecConfig()) is None
    diloco = build_outer_optimizer(
        start, OuterOptimConfig(method="diloco", diloco_lr=0.5), CodecConfig(pseudo_gradients="bf16")
    )
    assert isinstance(diloco, DiLoCo) and diloco.optimizer.param_groups[0]["lr"] == 0.5
    assert isinstance(build_outer_optimizer(start, OuterOptimConfig(method="sparseloco"), CodecConfig()), SparseLoCo)
    with pytest.raises(ValueError, match="does not fit"):
        build_outer_optimizer(start, OuterOptimConfig(method="diloco"), CodecConfig(pseudo_gradients="sparseloco"))


def test_a_replica_behind_in_warm_up_keeps_the_groups_larger_deltas() -> None:
    """Random routing leaves a replica a few inner steps (and, in warm-up, a far smaller Δ): with a group to
    take the median of, its own history must not drop the others' honest Δs."""
    torch.manual_seed(3)
    start = {"w": torch.randn(16, 8)}
    replicas = [
        (DiLoCo(start, lr=1.0, momentum=0.0, codec=get_codec("fp32")), {"w": start["w"].clone()}) for _ in range(4)
    ]
    for k, (_, local) in enumerate(replicas):
        local["w"] -= (0.001 if k == 0 else 0.05) * torch.randn(16, 8)  # replica 0 took far fewer steps
    payloads = [opt.make_payload(local) for opt, local in replicas]
    screenings = [opt.apply(payloads, local) for opt, local in replicas]
    assert all(s.used == 4 and not s.dropped for s in screenings)
    assert all(torch.equal(replicas[0][0].global_params["w"], opt.global_params["w"]) for opt, _ in replicas)
