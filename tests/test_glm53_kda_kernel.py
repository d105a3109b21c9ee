"""The chunked KDA Triton kernels (``families/glm53/kernels/kda_triton.py``) under the CPU interpreter,
against the torch reference (:func:`~reference_impl.families.glm53.model.kda.kda_chunked`, itself checked
against ``transformers`` in ``tests/test_glm53_model.py``), and the dispatch that picks between them.

Inputs are drawn as the layer makes them, at tiny-glm53's head sizes (2 heads of 16): ``q``, ``k`` of unit
norm (``q`` scaled by ``Dk^-0.5``), ``v`` and the entering state ``N(0, 1)``, ``beta`` in ``(0, 1)``, the
gate ``g = bound * sigmoid(x)`` in ``(bound, 0)``: weak (``bound = -0.05``: the state carries across
chunks and the entering state matters) or strong (``x`` drawn near ``+6``: ``g`` within 1% of the
lower bound ``-5``, most of the state forgotten at every token).

Tolerance ``TOL = 1e-5`` of ``max(1, max |reference|)``. Both sides run the same chunked algorithm in
float32 and differ only in summation order: each value is a sum of at most ``C + Dk = 80`` products,
whose reordering changes it by at most about ``80 * 2^-24 ~ 5e-6`` of its scale; every state map
factor ``(I - beta k k^T) diag(exp g)`` is a contraction, so later chunks do not amplify it. A bf16
state would be off by ``2^-9 ~ 2e-3`` of its scale: the tolerance checks that the state stays float32.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from reference_impl.families.glm53 import bench as glm53_bench
from reference_impl.families.glm53.config import PRESETS
from reference_impl.families.glm53.family import FAMILY
from reference_impl.families.glm53.kernels import dispatch, kda_triton
from reference_impl.families.glm53.kernels.kda_triton import kda_bytes_per_token, kda_chunked_triton, span_map_triton
from reference_impl.families.glm53.model.kda import KDA_TORCH_OPS, KDAttention, compose, kda_chunked, span_map
from reference_impl.families.glm53.model.oracle import run_glm53_oracle
from reference_impl.kernels import fallback

TOL = 1e-5
TINY = PRESETS["tiny-glm53"]
H, D = TINY.linear_num_heads, TINY.linear_head_dim
Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _inputs(T: int, gate: str = "weak", seed: int = 0, Dk: int = D, Dv: int = D) -> Inputs:
    """``(q, k, v, g, beta, state)`` float32, as the layer makes them (see the module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(T, H, Dk, generator=gen), dim=-1) * Dk**-0.5
    k = F.normalize(torch.randn(T, H, Dk, generator=gen), dim=-1)
    v = torch.randn(T, H, Dv, generator=gen)
    x = torch.randn(T, H, Dk, generator=gen)
    if gate == "weak":
        g = -0.05 * torch.sigmoid(x)
    elif gate == "strong":
        g = -5.0 * torch.sigmoid(6.0 + 0.1 * x)
    else:  # "unbounded": the softplus gate (no lower bound) at its steepest, -60 .. 0 per token
        g = -60.0 * torch.sigmoid(x)
    beta = torch.sigmoid(torch.randn(T, H, generator=gen))
    state = torch.randn(H, Dk, Dv, generator=gen)
    return q, k, v, g, beta, state


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == torch.float32
    scale = max(1.0, float(want.abs().max()))
    err = float((got - want).abs().max())
    assert err <= TOL * scale, (err, scale)


def _recurrence(q, k, v, g, beta, state):  # noqa: ANN001, ANN202 (the test's witness, float64)
    """The gated delta rule token by token, in float64: the definition the chunked forms factor."""
    S = state.double().clone()
    out = []
    for t in range(len(q)):
        S = S * g[t].double().exp()[..., None]
        kt, vt, bt = k[t].double(), v[t].double(), beta[t].double()[:, None]
        v_new = vt - torch.einsum("hk,hkv->hv", kt, S)
        S = S + torch.einsum("hk,hv->hkv", kt, bt * v_new)
        out.append(torch.einsum("hk,hkv->hv", q[t].double(), S))
    return torch.stack(out), S


@pytest.mark.parametrize("entering", ["zero", "random"])
@pytest.mark.parametrize("T", [1, 7, 63, 64, 65, 130])
def test_kernel_matches_the_reference(T: int, entering: str) -> None:
    """Outputs and final state against ``kda_chunked``: lengths around the 64-token chunk, from a zero
    state (a prefill's start) and from a random one (a later chunk or CP block)."""
    q, k, v, g, beta, state = _inputs(T, seed=T)
    if entering == "zero":
        state = torch.zeros_like(state)
    out, final = kda_chunked_triton(q, k, v, g, beta, state)
    want_out, want_final = kda_chunked(q, k, v, g, beta, state)
    _close(out, want_out)
    _close(final, want_final)
    assert final.shape == (H, D, D) and out.shape == (T, H, D)


@pytest.mark.parametrize(("gate", "T"), [("strong", 65), ("strong", 130), ("unbounded", 130)])
def test_strong_gates(gate: str, T: int) -> None:
    """Gates at the lower bound, and the unbounded softplus gate's decays of up to ``exp(-60)`` per
    token (``exp(G_i - G_j)`` spans ``e^-3800`` in a chunk): no overflow, no NaN, the reference's result."""
    q, k, v, g, beta, state = _inputs(T, gate, seed=3)
    out, final = kda_chunked_triton(q, k, v, g, beta, state)
    want_out, want_final = kda_chunked(q, k, v, g, beta, state)
    assert bool(torch.isfinite(out).all()) and bool(torch.isfinite(final).all())
    _close(out, want_out)
    _close(final, want_final)


def test_kernel_is_the_token_by_token_recurrence() -> None:
    """Against the definition itself (float64, one token at a time), not only the chunked reference."""
    q, k, v, g, beta, state = _inputs(130, seed=11)
    out, final = kda_chunked_triton(q, k, v, g, beta, state)
    want_out, want_final = _recurrence(q, k, v, g, beta, state)
    _close(out, want_out.float())
    _close(final, want_final.float())
    assert float((want_final.float() - state).abs().max()) > 0.1  # the span changed the state


def test_near_collinear_keys() -> None:
    """Keys within ~1% of one direction, ``beta`` near 1 and almost no decay: the chunk's triangular system
    has entries near 1 throughout (the forward substitution's hardest case); still the recurrence's answer."""
    q, k, v, g, beta, state = _inputs(130, seed=13)
    gen = torch.Generator().manual_seed(14)
    k = F.normalize(torch.randn(1, H, D, generator=gen) + 0.01 * torch.randn(130, H, D, generator=gen), dim=-1)
    g, beta = g / 50.0, torch.full_like(beta, 0.999)
    out, final = kda_chunked_triton(k * D**-0.5, k, v, g, beta, state)
    want_out, want_final = _recurrence(k * D**-0.5, k, v, g, beta, state)
    _close(out, want_out.float())
    _close(final, want_final.float())


@pytest.mark.parametrize(("chunk", "Dk", "Dv"), [(16, 16, 16), (32, 16, 32), (64, 24, 40)])
def test_other_chunks_and_padded_head_dims(chunk: int, Dk: int, Dv: int) -> None:
    """Chunks of 16 and 32 tokens; head dims that are no power of two (padded to the block, masked)."""
    q, k, v, g, beta, state = _inputs(70, seed=5, Dk=Dk, Dv=Dv)
    out, final = kda_chunked_triton(q, k, v, g, beta, state, chunk=chunk)
    want_out, want_final = kda_chunked(q, k, v, g, beta, state)
    _close(out, want_out)
    _close(final, want_final)


def test_bf16_inputs_keep_a_float32_state() -> None:
    """bf16 inputs (the GPU's) are upcast as loaded; outputs and state are float32 and agree with the
    reference on the same inputs within ``TOL``, which a bf16-rounded state would miss."""
    q, k, v, g, beta, state = (t.bfloat16() for t in _inputs(65, seed=9))
    out, final = kda_chunked_triton(q, k, v, g, beta, state)
    want_out, want_final = kda_chunked(q, k, v, g, beta, state)
    assert out.dtype == final.dtype == torch.float32
    _close(out, want_out)
    _close(final, want_final)
    scale = max(1.0, float(want_final.abs().max()))
    assert float((want_final.bfloat16().float() - want_final).abs().max()) > TOL * scale


@pytest.mark.parametrize(("T", "gate"), [(7, "weak"), (130, "weak"), (65, "strong")])
def test_span_map_matches_the_reference_and_composes(T: int, gate: str) -> None:
    """``(A, B)`` against ``span_map``; ``A S + B`` is the state the recurrence reaches from ``S``."""
    q, k, v, g, beta, state = _inputs(T, gate, seed=T + 1)
    A, B = span_map_triton(k, v, g, beta)
    want_A, want_B = span_map(k, v, g, beta)
    _close(A, want_A)
    _close(B, want_B)
    _, want_final = kda_chunked(q, k, v, g, beta, state)
    _close(compose(state, A, B), want_final)
    if gate == "weak":
        # the entering state survives the span (decayed and partly overwritten): A is well above TOL
        assert float(want_A.abs().max()) > 100 * TOL


def test_empty_span() -> None:
    q, k, v, g, beta, state = _inputs(0)
    out, final = kda_chunked_triton(q, k, v, g, beta, state)
    assert out.shape == (0, H, D) and torch.equal(final, state)
    A, B = span_map_triton(k, v, g, beta)
    assert torch.equal(A, torch.eye(D).expand(H, D, D)) and not B.any()


def _bad(name: str) -> Inputs:
    """Inputs whose argument ``name`` has a wrong shape (``state``: an integer dtype)."""
    args = dict(zip(("q", "k", "v", "g", "beta", "state"), _inputs(5)))
    wrong = {
        "q": args["q"][:, 0],
        "k": args["k"][..., :8],
        "v": args["v"][:4],
        "g": args["g"][None],
        "beta": args["beta"][:, :1],
        "state": args["state"].to(torch.int32),
    }
    args[name] = wrong[name]
    return tuple(args.values())  # type: ignore[return-value]


@pytest.mark.parametrize("name", ["q", "k", "v", "g", "beta", "state"])
@pytest.mark.parametrize("entry", ["kernel", "dispatch", "reference"])
def test_bad_inputs_are_refused_by_name(name: str, entry: str) -> None:
    """Each argument's wrong shape (``state``: an integer tensor) is refused naming it, on every path,
    before anything runs (the dispatch's fallback never sees it)."""
    fn = {"kernel": kda_chunked_triton, "dispatch": dispatch.kda_chunked, "reference": kda_chunked}[entry]
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        fn(*_bad(name))


def test_bad_options_are_refused_by_name() -> None:
    args = _inputs(5)
    with pytest.raises(ValueError, match="^chunk=48"):
        kda_chunked_triton(*args, chunk=48)
    with pytest.raises(ValueError, match="^dot_precision="):
        kda_chunked_triton(*args, dot_precision="bf16")
    with pytest.raises(ValueError, match=r"^beta\b"):
        span_map_triton(args[1], args[2], args[3], args[4][:, :1])
    with pytest.raises(ValueError, match=r"^kernel="):
        glm53_bench.kda_tokens_per_second(8, 1, 16, device="cpu", kernel="cuda")


def test_bytes_per_token_counts_the_docstring() -> None:
    """The module docstring's figure at GLM-5.3-Flash dims (bf16 inputs): 6.4 KB per token and head."""
    assert kda_bytes_per_token(128, 128, 2) == 6402
    assert kda_bytes_per_token(128, 128, 2, outputs=False) == 6402
    assert kda_bytes_per_token(128, 128, 4) > kda_bytes_per_token(128, 128, 2)


# ---- the dispatch -------------------------------------------------------------------------------


def test_dispatch_takes_torch_off_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU tensor the dispatch runs the reference (bit for bit), never the kernel."""
    args = _inputs(20)
    monkeypatch.setattr(kda_triton, "kda_chunked_triton", lambda *a, **k: pytest.fail("kernel ran"))
    monkeypatch.setattr(kda_triton, "span_map_triton", lambda *a, **k: pytest.fail("kernel ran"))
    assert dispatch.kda_kernel_name(args[0].device) == "torch"
    for got, want in zip(dispatch.kda_chunked(*args), kda_chunked(*args)):
        assert torch.equal(got, want)
    for got, want in zip(dispatch.span_map(*args[1:5]), span_map(*args[1:5])):
        assert torch.equal(got, want)


@pytest.fixture
def kernels_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """The dispatch told that kernels run (the Triton interpreter on CPU)."""
    monkeypatch.setattr(fallback, "use_kernels", lambda *a, **k: not k.get("force_torch", False))
    monkeypatch.setattr(fallback, "_FAILED", {})


def test_dispatch_runs_the_kernel_where_kernels_run(kernels_on: None, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real_chunked, real_map = kda_triton.kda_chunked_triton, kda_triton.span_map_triton
    monkeypatch.setattr(kda_triton, "kda_chunked_triton", lambda *a: calls.append("chunked") or real_chunked(*a))
    monkeypatch.setattr(kda_triton, "span_map_triton", lambda *a: calls.append("map") or real_map(*a))
    args = _inputs(40, seed=2)
    assert dispatch.kda_kernel_name("cpu") == "triton"
    for got, want in zip(dispatch.kda_chunked(*args), kda_chunked(*args)):
        _close(got, want)
    for got, want in zip(dispatch.span_map(*args[1:5]), span_map(*args[1:5])):
        _close(got, want)
    assert calls == ["chunked", "map"]
    assert dispatch.kda_kernel_name("cpu", force_torch=True) == "torch"
    assert torch.equal(dispatch.kda_chunked(*args, force_torch=True)[1], kda_chunked(*args)[1])
    assert calls == ["chunked", "map"]


def test_dispatch_falls_back_when_the_kernel_raises(kernels_on: None, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object) -> None:
        raise RuntimeError("no kernel today")

    monkeypatch.setattr(kda_triton, "kda_chunked_triton", broken)
    args = _inputs(20)
    for got, want in zip(dispatch.kda_chunked(*args), kda_chunked(*args)):
        assert torch.equal(got, want)
    assert "no kernel today" in fallback.fallbacks_taken()["Triton GLM-5.3 KDA"]


def test_build_model_wires_the_kda_layers(kernels_on: None) -> None:
    """``kernels=True`` puts the dispatch table in every KDA layer, ``kernels=False`` the torch one; the
    oracle through the kernels (the interpreter) agrees with the torch oracle over a prefix and two chunks."""
    cfg = TINY
    kernel_model = FAMILY.build_model(cfg, torch.float32, 0, torch.device("cpu"), kernels=True)
    torch_model = FAMILY.build_model(cfg, torch.float32, 0, torch.device("cpu"), kernels=False)
    kda_layers = [b.attn for b in kernel_model.layers if isinstance(b.attn, KDAttention)]
    assert len(kda_layers) == cfg.count("linear_attention") == 2
    assert all(attn.ops is dispatch.KDA_KERNEL_OPS for attn in kda_layers)
    assert all(b.attn.ops is KDA_TORCH_OPS for b in torch_model.layers if isinstance(b.attn, KDAttention))
    x = torch.randn(90, cfg.dim, generator=torch.Generator().manual_seed(4))
    got = run_glm53_oracle(kernel_model, [30], [x], torch.float32, chunk_size=40)
    want = run_glm53_oracle(torch_model, [30], [x], torch.float32, chunk_size=40)
    _close(got.hidden[0], want.hidden[0])
    for layer in (0, 3):
        _close(got.caches[layer][0].state, want.caches[layer][0].state)
