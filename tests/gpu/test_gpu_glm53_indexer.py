"""GLM-5.3's pooled indexer through the DSA logits and top-k kernels compiled on CUDA (GPU tier), at
GLM-5.3-Flash's indexer shape: 32 heads of 128, groups of 16 tokens, 128 groups selected.

Scores against the torch reference on the same GPU in float32 (TF32 off) within the reordering bound of
``tests/test_glm53_indexer_kernel.py`` (``2 (D + H + 2) 2^-24`` of each entry's magnitude): the kernel's
float32 keys and IEEE float32 products (``dot_dtype="fp32"``) must hold it where bf16 keys do not.
Selections from the same scores bit for bit (ties to the lower group id). The dispatch picks the kernels,
and tiny-glm53's oracle through the kernel table selects what the torch table does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
import torch

if TYPE_CHECKING:
    from reference_impl.families.glm53.config import Glm53Config

pytestmark = pytest.mark.gpu

U = 2.0**-24
HEADS, DIM, KPOOL = 32, 128, 16  # GLM-5.3-Flash: index_n_heads, index_head_dim, index_kpool


@pytest.fixture(autouse=True)
def _float32_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference's matmuls in IEEE float32: TF32 would round them to ~1e-3."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)


def _inputs(T: int, G: int, seed: int) -> tuple[torch.Tensor, ...]:
    """``(index_q, index_w, group_keys, positions)`` on CUDA: ``q``, keys ``N(0, 1)`` float32 (every fifth key
    zero: exact ties at 0), ``w`` scaled by ``heads^-0.5`` as the layer does; positions in no order, the
    first seeing no group, the last every group."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(T, HEADS, DIM, generator=gen, device="cuda")
    w = torch.randn(T, HEADS, generator=gen, device="cuda") * HEADS**-0.5
    k = torch.randn(G, DIM, generator=gen, device="cuda")
    k[::5] = 0.0
    positions = torch.randint(0, (G + 2) * KPOOL, (T,), generator=gen, device="cuda")
    positions[0], positions[-1] = KPOOL - 2, (G + 1) * KPOOL
    return q, w, k, positions


def _bound(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    magnitude = torch.einsum("th,thg->tg", w.abs(), torch.einsum("thd,gd->thg", q.abs(), k.abs())) * DIM**-0.5
    return 2 * (DIM + HEADS + 2) * U * magnitude


def _flash() -> Glm53Config:
    from reference_impl.families.glm53.config import PRESETS

    cfg = PRESETS["glm-5.3-flash"]
    assert (cfg.index_n_heads, cfg.index_head_dim, cfg.index_kpool, cfg.groups_selected) == (HEADS, DIM, KPOOL, 128)
    return cfg


@pytest.mark.parametrize(("T", "G"), [(1, 1), (3001, 700)])
def test_scores_at_flash_shape(T: int, G: int) -> None:
    from reference_impl.families.glm53.kernels import dispatch
    from reference_impl.families.glm53.model import dsa
    from reference_impl.kernels import fallback

    q, w, k, positions = _inputs(T, G, seed=T)
    visible = dsa.visible_groups(positions, KPOOL, G)
    assert dispatch.indexer_kernel_name(q.device) == "triton"
    got = dispatch.group_scores(q, w, k, DIM, visible)
    want = dsa.group_scores(q, w, k, DIM, visible)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    seen, bound = torch.isfinite(want), _bound(q, w, k)
    assert bool(((got - want).abs() <= bound)[seen].all())
    assert bool((got[:, ::5][seen[:, ::5]] == 0).all())
    if G > 1:  # bf16 keys break the bound: it checks that the keys and products stay float32
        rounded = dsa.group_scores(q, w, k.bfloat16().float(), DIM, visible)
        assert bool(((rounded - want).abs() > bound)[seen].any())
    assert "Triton GLM-5.3 indexer scores" not in fallback.fallbacks_taken()


def test_select_at_flash_shape() -> None:
    """128 of up to 700 groups per query, from the kernel's scores and from scores tied at every rank."""
    from reference_impl.families.glm53.kernels import dispatch
    from reference_impl.families.glm53.model import dsa
    from reference_impl.kernels import fallback

    cfg = _flash()
    q, w, k, positions = _inputs(3001, 700, seed=1)
    scores = dispatch.group_scores(q, w, k, DIM, dsa.visible_groups(positions, KPOOL, 700))
    gen = torch.Generator(device="cuda").manual_seed(2)
    values = torch.tensor([-1.5, -0.0, 0.0, 0.25, 2.0], device="cuda")
    tied = values[torch.randint(0, 5, scores.shape, generator=gen, device="cuda")]
    for s in (scores, tied):
        assert torch.equal(dispatch.select(cfg, s, positions), dsa.select(cfg, s, positions))
    assert "Triton GLM-5.3 group selection" not in fallback.fallbacks_taken()


def test_model_with_the_indexer_kernels_selects_as_the_torch_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """tiny-glm53 in float32 on CUDA, its KDA layers on the torch references in both models (so the indexers'
    inputs agree bit for bit): the oracle's selections through the indexer kernels equal the torch table's."""
    from reference_impl.families.glm53.config import PRESETS
    from reference_impl.families.glm53.family import FAMILY
    from reference_impl.families.glm53.kernels import dispatch
    from reference_impl.families.glm53.model.kda import KDA_TORCH_OPS
    from reference_impl.families.glm53.model.oracle import run_glm53_oracle

    monkeypatch.setattr(dispatch, "KDA_KERNEL_OPS", KDA_TORCH_OPS)
    cfg, dev = PRESETS["tiny-glm53"], torch.device("cuda")
    kernel_model = FAMILY.build_model(cfg, torch.float32, 0, dev, kernels=True)
    torch_model = FAMILY.build_model(cfg, torch.float32, 0, dev, kernels=False)
    x = torch.randn(300, cfg.dim, generator=torch.Generator(device="cuda").manual_seed(4), device="cuda")
    got = run_glm53_oracle(kernel_model, [100], [x], torch.float32, chunk_size=130)
    want = run_glm53_oracle(torch_model, [100], [x], torch.float32, chunk_size=130)
    for layer in range(cfg.n_layers):
        assert torch.equal(got.selections[layer][0], want.selections[layer][0]), layer
