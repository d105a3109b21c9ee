"""Two tiers, one suite.

* **CPU tier** (``pytest tests``, the default; CI): every test not marked ``gpu``. Triton kernels run
  under the interpreter (``TRITON_INTERPRET=1``) and CUDA is hidden (``CUDA_VISIBLE_DEVICES=``), so
  a test cannot pick a GPU by accident: what a CPU test checks runs on CPU tensors on any machine.
  CPU ranks run one thread each (``DSACP_RANK_THREADS=1``, unless set), as on CI. Under
  pytest-xdist (``-n N``) each worker computes on its share of the cores.
* **GPU tier** (``pytest --gpu tests``): only the tests marked ``gpu`` (``tests/gpu/``), with the
  compiled kernels on a CUDA device; skipped where no CUDA device is visible.

Both environment variables must be set before Triton compiles a kernel module or CUDA initializes,
which is why the tier is decided here, in ``pytest_configure``, before any test module is imported.
Shared fixtures: small CP runs on CPU (gloo) cached per configuration; ``forked_ranks`` for a test
whose monkeypatches the ranks must inherit.
"""

from __future__ import annotations

import functools
import importlib
import os

import pytest

GPU_TIER_HELP = "run the GPU tier (tests marked gpu, compiled kernels on CUDA) instead of the CPU tier"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--gpu", action="store_true", default=False, help=GPU_TIER_HELP)


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--gpu"):
        if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
            raise pytest.UsageError("the GPU tier runs compiled kernels: unset TRITON_INTERPRET")
        return
    os.environ["TRITON_INTERPRET"] = "1"  # Triton kernels run under the interpreter on CPU
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the CPU tier never touches a GPU, even on a GPU machine
    # One thread per CPU rank on any machine, as on the 2-core CI machine: ranks fork (fast) and
    # tiny runs pay no thread-pool overhead. The several-thread path has its own tests.
    os.environ.setdefault("DSACP_RANK_THREADS", "1")
    import torch

    # Under pytest-xdist (scripts/test.sh on a machine with cores to spare) the workers share the
    # cores: each computes on its share, so N workers do not each start a pool of every core.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers > 1:
        from reference_impl.machine import cpu_cores

        torch.set_num_threads(max(1, cpu_cores() // workers))

    if torch.cuda.is_initialized():
        raise pytest.UsageError("CUDA was initialized before the CPU tier could hide it")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups (``--dist loadgroup``)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_tier = config.getoption("--gpu")
    if gpu_tier:
        keep = [item for item in items if "gpu" in item.keywords]
        config.hook.pytest_deselected(items=[item for item in items if "gpu" not in item.keywords])
        items[:] = keep
        # Under pytest-xdist (scripts/test.sh on a CUDA machine) the modules that launch CP ranks
        # (``gpu_ranks``) run one after another on one worker: each sizes itself against the GPU's free
        # memory, and each launch's processes load the host's cores (on the H200 box, two such chains
        # side by side made the whole command slower, not faster). A kernel module stays whole on one
        # worker (its module fixtures are built once).
        for item in keep:
            group = "gpu-ranks" if "gpu_ranks" in item.keywords else item.nodeid.split("::")[0]
            item.add_marker(pytest.mark.xdist_group(group))
        import torch

        if not torch.cuda.is_available():
            skip = pytest.mark.skip(reason="GPU tier: no CUDA device is visible")
            for item in items:
                item.add_marker(skip)
        return
    skip = pytest.mark.skip(reason="GPU tier: run `pytest --gpu tests` on a CUDA machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@functools.cache
def cached_report(run: object) -> dict:
    from reference_impl.runner import run_prefill

    return run_prefill(run, timeout_s=120)  # type: ignore[arg-type]


@pytest.fixture
def report_of():
    return cached_report


@pytest.fixture
def forked_ranks(monkeypatch):
    """CPU ranks (and the oracle) compute on one thread each, so the launcher forks them and they
    inherit this test's monkeypatches; with several threads per rank (a many-core machine) it
    would start them from a fork server, where no patch reaches."""
    monkeypatch.setenv("DSACP_RANK_THREADS", "1")
    return monkeypatch


def tiny(**changes):  # -> RunConfig
    """The tiny preset on CPU (2 ranks, two requests, no phases) with ``changes`` applied."""
    from reference_impl.config import PhaseSet, Request, RunConfig

    base = RunConfig(
        preset="tiny", cp_size=2, requests=(Request(0, 96), Request(40, 70)), phases=PhaseSet(), device="cpu"
    )
    return base.replace(**changes)


def as_bytes(t):  # -> torch.Tensor
    """``t``'s bytes (uint8), to compare packed outputs byte for byte."""
    import torch

    return t.contiguous().view(torch.uint8)


# The Triton kernel modules, for the CPU tier's interpreter tests.


@pytest.fixture(scope="module")
def fs() -> object:
    return importlib.import_module("reference_impl.kernels.fused_store")


@pytest.fixture(scope="module")
def fr() -> object:
    return importlib.import_module("reference_impl.kernels.fused_rerange")


@pytest.fixture(scope="module")
def fm() -> object:
    return importlib.import_module("reference_impl.kernels.fused_materialize")


def gluon_operand_refusals():  # -> dict[str, list[tuple]]
    """Inputs both Gluon kernels refuse through ``hopper_operand_reason`` (``unsupported_reason``'s
    arguments), keyed by words of the reason: not sm_90, or not one bf16 / fp16 dtype."""
    import torch

    bf16 = torch.bfloat16
    return {
        "sm_90": [
            ("cpu", None, bf16, bf16, 576, 512),
            ("cuda", (8, 0), bf16, bf16, 576, 512),
            ("cuda", (10, 0), bf16, bf16, 576, 512),
        ],
        "bf16 or fp16": [
            ("cuda", (9, 0), torch.float32, torch.float32, 576, 512),
            ("cuda", (9, 0), bf16, torch.float16, 576, 512),
        ],
    }
