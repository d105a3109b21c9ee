"""GLM-5.3's pooled indexer through the DSA family's kernels (``families/glm53/kernels/dispatch.py``: the
indexer logits kernel scores the pooled group keys, the top-k selection kernel picks the groups) under the
CPU interpreter, against the torch references (:func:`~reference_impl.families.glm53.model.dsa.group_scores`
and :func:`~reference_impl.families.glm53.model.dsa.select`), the dispatch's paths, the model built with the
kernel table, and a CP run through it at C = 2.

**Scores** are compared per entry within ``BOUND = 2 (D + H + 2) 2^-24`` of the entry's magnitude
``m = Di^-0.5 sum_h |w_h| sum_d |q_hd k_d|``: both sides sum the same ``H D`` float32 products in other
orders (the reference scales before the ReLU, the kernel after the head sum: the same value in exact
arithmetic, ``relu(x s) = s relu(x)`` for ``s > 0``), and a sum of ``n`` terms reordered moves by at most
``n 2^-24`` of the sum of their magnitudes on each side. Keys rounded to bf16 miss that bound (asserted), so
it checks that the kernel keeps the keys and products float32. Invisible groups are ``-inf`` on both sides,
exactly. **Selections** are compared bit for bit: from the same scores the kernel's tie rule (the lowest
columns among ties at the k-th score) is the reference's stable sort.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch

import reference_impl as ri
from reference_impl.config import PhaseSet, Request, RunConfig, compute_dtype
from reference_impl.families.glm53.config import PRESETS, Glm53Config
from reference_impl.families.glm53.family import FAMILY, latent_rows
from reference_impl.families.glm53.kernels import dispatch
from reference_impl.families.glm53.model import dsa
from reference_impl.families.glm53.model.dsa import INDEXER_TORCH_OPS, MLAttention, visible_groups
from reference_impl.families.glm53.model.kda import KDA_TORCH_OPS
from reference_impl.families.glm53.model.oracle import run_glm53_oracle
from reference_impl.kernels import fallback, indexer_triton, topk_select
from reference_impl.workload import build_inputs, build_model

TINY = PRESETS["tiny-glm53"]
P = TINY.index_kpool
U = 2.0**-24


def _inputs(T: int, G: int, seed: int = 0, H: int = 4, D: int = 16) -> tuple[torch.Tensor, ...]:
    """``(index_q [T, H, D], index_w [T, H], group_keys [G, D])`` float32, ``N(0, 1)``; every third key zero:
    its score is exactly 0 (ties) on both sides."""
    gen = torch.Generator().manual_seed(seed)
    q, w, k = torch.randn(T, H, D, generator=gen), torch.randn(T, H, generator=gen), torch.randn(G, D, generator=gen)
    k[::3] = 0.0
    return q, w, k


def _bound(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``[T, G]``: the reordering bound of the module docstring."""
    H, D = q.shape[1], q.shape[2]
    magnitude = torch.einsum("th,thg->tg", w.abs(), torch.einsum("thd,gd->thg", q.abs(), k.abs())) * D**-0.5
    return 2 * (D + H + 2) * U * magnitude


def _positions(T: int, G: int, seed: int) -> torch.Tensor:
    """Query positions in no order: the first before the first group ends (nothing visible), the last past the
    last group (every group visible), the others anywhere up to two groups past the last."""
    gen = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, (G + 2) * P, (T,), generator=gen)
    positions[0], positions[-1] = P - 2, (G + 1) * P
    return positions


@pytest.fixture
def kernels_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """The dispatch told that kernels run (the Triton interpreter on CPU)."""
    monkeypatch.setattr(fallback, "use_kernels", lambda *a, **k: not k.get("force_torch", False))
    monkeypatch.setattr(fallback, "_FAILED", {})


# ---- the kernels against the references ------------------------------------------------------------


@pytest.mark.parametrize(("T", "G"), [(1, 1), (5, 3), (37, 7), (19, 130)])
def test_scores_match_the_reference(kernels_on: None, T: int, G: int) -> None:
    """Unaligned query and group counts (130 groups: two key tiles of the kernel), per-query visible ranges
    from none to all, and without a range (every group scored)."""
    q, w, k = _inputs(T, G, seed=T + G)
    positions = _positions(T, G, seed=G)
    visible = visible_groups(positions, P, G)
    assert (visible == G).any() and ((visible == 0).any() or T == 1)
    for bound_by in (visible, None):
        got = dispatch.group_scores(q, w, k, q.shape[2], bound_by)
        want = dsa.group_scores(q, w, k, q.shape[2], bound_by)
        assert got.shape == (T, G) and got.dtype == torch.float32
        assert torch.equal(torch.isinf(got), torch.isinf(want))  # the invisible groups, exactly
        seen = torch.isfinite(want)
        assert bool(((got - want).abs() <= _bound(q, w, k))[seen].all())
        assert bool((got[:, ::3][seen[:, ::3]] == 0).all())  # zero keys: exact zeros (ties) on both sides
    assert fallback.fallbacks_taken() == {}


def test_the_bound_catches_bf16_keys() -> None:
    """Keys rounded to bf16 (what a bf16 dot would do) move scores past the bound: it checks float32."""
    q, w, k = _inputs(37, 7, seed=3)
    want = dsa.group_scores(q, w, k, 16)
    rounded = dsa.group_scores(q, w, k.bfloat16().float(), 16)
    assert bool(((rounded - want).abs() > _bound(q, w, k)).any())


def _tied_scores(T: int, G: int, seed: int) -> torch.Tensor:
    """Scores from five values, ``-0.0`` and ``+0.0`` among them: ties at every rank."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.tensor([-1.5, -0.0, 0.0, 0.25, 2.0])
    return values[torch.randint(0, 5, (T, G), generator=gen)]


@pytest.mark.parametrize(
    ("T", "G", "groups_selected"), [(1, 1, 1), (1, 1, 2), (23, 6, 1), (23, 6, 2), (23, 6, 5), (12, 130, 2)]
)
def test_select_matches_the_reference(kernels_on: None, T: int, G: int, groups_selected: int) -> None:
    """Bit for bit from the same scores: ties (and ``-0.0`` against ``+0.0``) to the lower group id, queries
    seeing no group, fewer groups than they may select, or all of them."""
    cfg = dataclasses.replace(TINY, index_topk=groups_selected * P)
    positions = _positions(T, G, seed=T)
    for scores in (_tied_scores(T, G, seed=G), dsa.group_scores(*_inputs(T, G, seed=1), 16)):
        got = dispatch.select(cfg, scores, positions)
        assert got.shape == (T, cfg.selection_width) and got.dtype == torch.int32
        assert torch.equal(got, dsa.select(cfg, scores, positions))
    assert fallback.fallbacks_taken() == {}


def test_select_ties_go_to_the_lower_group(kernels_on: None) -> None:
    """Every visible group tied at 0 and a better group not yet visible: the lowest visible ids are chosen."""
    cfg = dataclasses.replace(TINY, index_topk=2 * P)
    scores = torch.zeros(3, 5)
    scores[:, 4] = 9.0  # group 4 ends at token 79: visible to the last query only
    positions = torch.tensor([10, 63, 79])  # 0, 4 and 5 groups visible
    got = dispatch.select(cfg, scores, positions)
    assert torch.equal(got, dsa.select(cfg, scores, positions))
    assert got[0].max() == 10 and (got[0] >= 0).sum() == 11  # no group: the tail, tokens 0 .. 10
    assert got[1][got[1] >= 0].tolist() == list(range(32))  # four visible, all tied: groups 0 and 1
    assert got[2][got[2] >= 0].tolist() == list(range(16)) + list(range(64, 80))  # group 4, then the lowest tie


def test_no_groups_and_no_queries(kernels_on: None) -> None:
    cfg = TINY
    q, w, k = _inputs(4, 0)
    scores = dispatch.group_scores(q, w, k, 16, visible_groups(torch.arange(4), P, 0))
    assert scores.shape == (4, 0)
    positions = torch.tensor([0, 5, 16, 40])
    assert torch.equal(dispatch.select(cfg, scores, positions), dsa.select(cfg, scores, positions))
    empty = torch.zeros(0, 3)
    assert dispatch.select(cfg, empty, torch.zeros(0, dtype=torch.long)).shape == (0, cfg.selection_width)


# ---- the dispatch ----------------------------------------------------------------------------------


def _spies(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record which DSA kernels the dispatch calls (the real ones run)."""
    calls: list[str] = []
    logits, topk = indexer_triton.indexer_logits_triton, topk_select.topk_select_triton
    monkeypatch.setattr(
        indexer_triton, "indexer_logits_triton", lambda *a, **k: calls.append("logits") or logits(*a, **k)
    )
    monkeypatch.setattr(topk_select, "topk_select_triton", lambda *a, **k: calls.append("topk") or topk(*a, **k))
    return calls


def test_dispatch_takes_torch_off_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CPU tensors the references run, bit for bit, never a kernel."""
    calls = _spies(monkeypatch)
    q, w, k = _inputs(20, 4)
    positions = _positions(20, 4, seed=0)
    visible = visible_groups(positions, P, 4)
    assert dispatch.indexer_kernel_name("cpu") == "torch"
    scores = dispatch.group_scores(q, w, k, 16, visible)
    assert torch.equal(scores, dsa.group_scores(q, w, k, 16, visible))
    assert torch.equal(dispatch.select(TINY, scores, positions), dsa.select(TINY, scores, positions))
    assert calls == []


def test_dispatch_paths(kernels_on: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where kernels run: both kernels; ``force_torch`` and explicit group ids: the references."""
    calls = _spies(monkeypatch)
    q, w, k = _inputs(20, 4)
    positions = _positions(20, 4, seed=0)
    assert dispatch.indexer_kernel_name("cpu") == "triton"
    assert dispatch.indexer_kernel_name("cpu", force_torch=True) == "torch"
    scores = dispatch.group_scores(q, w, k, 16, visible_groups(positions, P, 4))
    dispatch.select(TINY, scores, positions)
    assert calls == ["logits", "topk"]
    forced = dispatch.group_scores(q, w, k, 16, force_torch=True)
    assert torch.equal(forced, dsa.group_scores(q, w, k, 16))
    assert torch.equal(dispatch.select(TINY, forced, positions, force_torch=True), dsa.select(TINY, forced, positions))
    ids = torch.tensor([0, 2, 3, 5])  # not a prefix of the group list: the reference takes them
    assert torch.equal(dispatch.select(TINY, forced, positions, ids), dsa.select(TINY, forced, positions, ids))
    assert calls == ["logits", "topk"]


def test_dispatch_falls_back_when_a_kernel_raises(kernels_on: None, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no kernel today")

    monkeypatch.setattr(indexer_triton, "indexer_logits_triton", broken)
    monkeypatch.setattr(topk_select, "topk_select_triton", broken)
    q, w, k = _inputs(20, 4)
    positions = _positions(20, 4, seed=0)
    visible = visible_groups(positions, P, 4)
    scores = dispatch.group_scores(q, w, k, 16, visible)
    assert torch.equal(scores, dsa.group_scores(q, w, k, 16, visible))
    assert torch.equal(dispatch.select(TINY, scores, positions), dsa.select(TINY, scores, positions))
    taken = fallback.fallbacks_taken()
    assert "no kernel today" in taken["Triton GLM-5.3 indexer scores"]
    assert "no kernel today" in taken["Triton GLM-5.3 group selection"]


@pytest.mark.parametrize(
    ("name", "args"),
    [
        ("index_q", lambda q, w, k: (q[0], w, k)),
        ("index_q", lambda q, w, k: (q.long(), w, k)),
        ("index_w", lambda q, w, k: (q, w[:-1], k)),
        ("group_keys", lambda q, w, k: (q, w, k[:, :-1])),
        ("visible", lambda q, w, k: (q, w, k, torch.zeros(len(q)))),
        ("visible", lambda q, w, k: (q, w, k, torch.zeros(len(q) + 1, dtype=torch.long))),
    ],
)
def test_bad_scores_inputs_are_refused_by_name(kernels_on: None, name: str, args) -> None:  # noqa: ANN001
    q, w, k = _inputs(6, 3)
    bad = args(q, w, k)
    for scores in (dispatch.group_scores, dsa.group_scores):
        with pytest.raises(ValueError, match=f"^{name}"):
            scores(*bad[:3], 16, *bad[3:])


def test_bad_select_inputs_are_refused_by_name(kernels_on: None) -> None:
    with pytest.raises(ValueError, match="^scores"):
        dispatch.select(TINY, torch.zeros(4), torch.arange(4))
    with pytest.raises(ValueError, match="^positions"):
        dispatch.select(TINY, torch.zeros(4, 2), torch.arange(5))
    with pytest.raises(ValueError, match="^positions"):
        dispatch.select(TINY, torch.zeros(4, 2), torch.zeros(4))


# ---- the model and a CP run --------------------------------------------------------------------------


@pytest.fixture
def torch_kda(monkeypatch: pytest.MonkeyPatch) -> None:
    """The KDA layers on their torch references in a model built with ``kernels=True``: the KDA kernels have
    their own tests (``tests/test_glm53_kda_kernel.py``), and here the indexer's inputs are then the torch
    model's bit for bit, so its selections are compared exactly (and the interpreter's time is spent here)."""
    monkeypatch.setattr(dispatch, "KDA_KERNEL_OPS", KDA_TORCH_OPS)


def _indexed(model: torch.nn.Module) -> list[MLAttention]:
    return [b.attn for b in model.layers if isinstance(b.attn, MLAttention)]


def test_build_model_wires_the_indexers(kernels_on: None, torch_kda: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """``kernels=True`` puts the kernel table in every indexed layer, ``kernels=False`` the torch one; the
    oracle through the kernels (the interpreter) selects exactly what the torch oracle does."""
    cfg: Glm53Config = TINY
    kernel_model = FAMILY.build_model(cfg, torch.float32, 0, torch.device("cpu"), kernels=True)
    torch_model = FAMILY.build_model(cfg, torch.float32, 0, torch.device("cpu"), kernels=False)
    assert len(_indexed(kernel_model)) == cfg.count("indexed_attention") > 0
    assert all(attn.ops is dispatch.INDEXER_KERNEL_OPS for attn in _indexed(kernel_model))
    assert all(attn.ops is INDEXER_TORCH_OPS for attn in _indexed(torch_model))
    calls = _spies(monkeypatch)
    x = torch.randn(90, cfg.dim, generator=torch.Generator().manual_seed(4))
    got = run_glm53_oracle(kernel_model, [30], [x], torch.float32, chunk_size=40)
    want = run_glm53_oracle(torch_model, [30], [x], torch.float32, chunk_size=40)
    assert calls.count("logits") == calls.count("topk") > 0
    for layer in range(cfg.n_layers):
        assert torch.equal(got.selections[layer][0], want.selections[layer][0]), layer
    assert fallback.fallbacks_taken() == {}


def test_cp_through_the_kernel_table_matches_the_oracle(
    kernels_on: None, torch_kda: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """C = 2, level 3, unaligned prefix, extends and chunks: the ranks (forked, so the patches reach them)
    score and select through the kernels, and the run matches its oracle (built with the same table), whose
    selections are the torch oracle's."""
    monkeypatch.setenv("DSACP_RANK_THREADS", "1")  # fork: the patches reach the ranks
    logits = indexer_triton.indexer_logits_triton

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        (tmp_path / str(os.getpid())).touch()
        return logits(*args, **kwargs)

    monkeypatch.setattr(indexer_triton, "indexer_logits_triton", spy)
    run = RunConfig(
        preset="tiny-glm53",
        cp_size=2,
        phases=PhaseSet.level(3),
        page_size=4,
        chunk_size=23,
        kv_dtype="bf16",
        requests=(Request(37, 61), Request(0, 45)),
        device="cpu",
    )
    report = ri.run_prefill(run)
    assert report["matches_oracle"], report["problems"]
    assert report["attention_kernel"] == "glm53-kda-triton+indexer-triton"
    assert not report["kernel_fallbacks"], report["kernel_fallbacks"]
    ranks = {p.name for p in tmp_path.iterdir()} - {str(os.getpid())}
    assert len(ranks) == run.cp_size, ranks  # the kernel ran in every rank
    cpu = torch.device("cpu")
    inputs = build_inputs(run, cpu)
    prefixes, cache = [r.prefix for r in run.requests], latent_rows(run.model, run.kv_dtype)
    kernel_oracle = run_glm53_oracle(build_model(run, cpu), prefixes, inputs, cache, run.chunk_size)
    torch_model = FAMILY.build_model(run.model, compute_dtype(run, cpu), run.seed, cpu, kernels=False)
    torch_oracle = run_glm53_oracle(torch_model, prefixes, inputs, cache, run.chunk_size)
    for layer in range(run.model.n_layers):
        for got, want in zip(kernel_oracle.selections[layer], torch_oracle.selections[layer]):
            assert torch.equal(got, want), layer
