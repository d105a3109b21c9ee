"""What the GPU tier's PD tests of a family share: the decode's next token against the same step taken here
over the caches it received, moved to the GPU (the rounding-tolerant rule: kernels may split their reductions
differently from one launch to the next)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from reference_impl.check import ROUNDING_TOLERANCE
from reference_impl.config import RunConfig

if TYPE_CHECKING:  # the driver imports the engine: the tests import it when they run
    from reference_impl.prefill_decode import PDResult

# a family's decode step: (model, caches [layer][request], each request's tokens, inputs) -> next hidden states
Step = Callable[[Any, Any, Sequence[int], Sequence[torch.Tensor]], list[torch.Tensor]]


def _on(cache: Any, device: torch.device) -> Any:
    """A cache dataclass with its tensors on ``device``."""
    fields = dataclasses.fields(cache)
    return dataclasses.replace(
        cache, **{f.name: getattr(cache, f.name).to(device) for f in fields if torch.is_tensor(getattr(cache, f.name))}
    )


def check_the_decode_continues(run: RunConfig, result: PDResult, step: Step) -> None:
    """``result``'s next tokens equal ``step`` over its received caches on the GPU, within the rounding tolerance."""
    from reference_impl.pd.payload import next_token_inputs
    from reference_impl.workload import build_model

    cuda = torch.device("cuda")
    model = build_model(run, cuda)
    caches = [[_on(c, cuda) for c in per_layer] for per_layer in result.rows]
    want = step(model, caches, [r.total for r in run.requests], next_token_inputs(run, cuda))
    for got, ref in zip(result.next_token, want):
        assert got.shape == ref.shape == (1, run.model.dim) and bool(torch.isfinite(got).all())
        scale = max(1.0, ref.float().abs().max().item())
        assert (got.float() - ref.float().cpu()).abs().max().item() <= ROUNDING_TOLERANCE * scale
