"""Model families as plug-ins: a family written inside this test runs through the CP engine, the
orchestration imports no family and tests none, every preset is listed, every store keeps the protocol.

The test family (:data:`TOY_FAMILY`) is plain MLA without an indexer: one latent KV row per token
(``kv_dim`` wide, the key and the value), queries absorbed into the latent, dense causal attention,
float32 caches. It brings its own config, model, oracle, store (replicated at level 0 and 1, each
position's row on its owner with phase 2, the full view all-gathered per layer), layer step and
comparison, and uses only the shared CP machinery: the split, the page table and locs, ownership,
the all-gathers. Nothing outside this file changes for it.
"""

from __future__ import annotations

import ast
import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import reference_impl as ri
from reference_impl import families
from reference_impl.check import EXACT_TOLERANCE, Agreement, compare_outputs
from reference_impl.config import PhaseSet, Request, RunConfig
from reference_impl.cp.batch import BatchLocs
from reference_impl.cp.comm import CPGroup
from reference_impl.cp.ownership import Ownership
from reference_impl.cp.rerange import gather_current
from reference_impl.families import ChunkInputs, RankStore
from reference_impl.footprint import PROCESS_BASE, SAFETY, Footprint

PACKAGE = Path(__file__).resolve().parent.parent / "reference_impl"
TOY = "toy-mla"


# ---- the family ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToyConfig:
    """What the orchestration reads of a config: ``name``, ``n_layers``, ``dim``, ``with_layers``."""

    name: str = TOY
    n_layers: int = 3
    dim: int = 32
    kv_dim: int = 16
    n_heads: int = 2
    vocab_size: int = 48

    def with_layers(self, n_layers: int) -> ToyConfig:
        return dataclasses.replace(self, n_layers=n_layers)


class ToyBlock(nn.Module):
    def __init__(self, cfg: ToyConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.kv_dim, bias=False)
        self.wkv = nn.Linear(cfg.dim, cfg.kv_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.kv_dim, cfg.dim, bias=False)

    def attend(self, x: torch.Tensor, keys: torch.Tensor, key_end: torch.Tensor) -> torch.Tensor:
        """``x [T, dim]`` against ``keys [S, kv_dim]``; query ``t`` sees keys ``[0, key_end[t])``."""
        q = self.wq(x).view(len(x), self.cfg.n_heads, self.cfg.kv_dim)
        scores = torch.einsum("thd,sd->ths", q, keys) / math.sqrt(self.cfg.kv_dim)
        visible = torch.arange(len(keys))[None, :] < key_end[:, None]
        probs = scores.masked_fill(~visible[:, None, :], float("-inf")).softmax(-1)
        return self.wo(torch.einsum("ths,sd->thd", probs, keys).reshape(len(x), -1))


class ToyModel(nn.Module):
    def __init__(self, cfg: ToyConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(ToyBlock(cfg) for _ in range(cfg.n_layers))
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x.to(self.head.weight)).float()


@dataclass
class ToyOracle:
    hidden: list[torch.Tensor]  # per request: its extend tokens' final hidden states
    caches: list[list[torch.Tensor]]  # [layer][request]: every token's KV row


class ToyStore:
    """Every token's row in a float32 pool indexed by its logical loc: all of them on every rank
    (levels 0-1), or only the rows a rank owns (phase 2), the rest all-gathered into each layer's view."""

    name = "toy"

    def __init__(self, run: RunConfig, batch: BatchLocs, group: CPGroup) -> None:
        cfg = run.model
        self.group, self.batch, self.sharded = group, batch, run.phases.sharded_kv and group.size > 1
        self.ownership = Ownership(run.cp_size, run.interleave, run.page_size)
        self.slots = batch.n_pages * batch.page_size
        self.rows = torch.zeros(cfg.n_layers, self.slots, cfg.kv_dim)
        self.held = torch.zeros(self.slots, dtype=torch.bool)
        self.materialized_bytes = self.transient_bytes = 0

    @property
    def kv_bytes(self) -> int:
        return int(self.held.sum()) * self.rows.shape[0] * self.rows.shape[2] * 4

    @property
    def index_bytes(self) -> int:
        return 0

    @property
    def store_path(self) -> str:
        return "gathered" if self.sharded else "replicated"

    def bind(self, batch: BatchLocs) -> None:
        self.batch = batch

    def breakdown(self) -> dict[str, int]:
        return {}

    def mine(self, locs: torch.Tensor) -> torch.Tensor:
        return (
            self.ownership.owner(locs) == self.group.rank if self.sharded else torch.ones_like(locs, dtype=torch.bool)
        )

    def write(self, layer: int, locs: torch.Tensor, rows: torch.Tensor) -> None:
        keep = self.mine(locs)
        self.rows[layer, locs[keep]] = rows[keep].float()
        self.held[locs[keep]] = True

    def view(self, layer: int, locs: torch.Tensor) -> torch.Tensor:
        """``[len(locs), kv_dim]``: the request's rows, the ones other ranks own all-gathered."""
        if not self.sharded:
            return self.rows[layer, locs]
        owner = self.ownership.owner(locs)
        lengths = [int((owner == r).sum()) for r in range(self.group.size)]  # the same on every rank
        gathered = self.group.all_gather_padded(self.rows[layer, locs[owner == self.group.rank]], lengths, "toy_view")
        order = torch.cat([torch.nonzero(owner == r).flatten() for r in range(self.group.size)])
        out = torch.empty(len(locs), self.rows.shape[2])
        out[order] = gathered
        self.materialized_bytes += gathered.numel() * 4
        return out

    def stored_rows(self, layer: int, request_locs: list[torch.Tensor] | None = None) -> dict[int, tuple[Any, ...]]:
        out = {}
        for i, locs in enumerate(request_locs if request_locs is not None else self.batch.request_locs):
            positions = torch.nonzero(self.held[locs]).flatten()
            out[i] = (positions, self.rows[layer, locs[positions]].clone())
        return out


class ToyStep:
    def __init__(self, inputs: ChunkInputs) -> None:
        self.inputs = inputs
        meta, rank = inputs.meta, inputs.group.rank
        self.local = [(meta.token_request[g], meta.token_position[g]) for g in meta.local_tokens(rank)]
        self.transient_bytes = 0

    def begin(self) -> None:
        pass

    def step(self, layer: int, block: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        i, store = self.inputs, self.inputs.store
        kv_seq = gather_current(i.group, i.index, block.wkv(x), "kv", False, False)  # [T_chunk, kv_dim], sequence order
        start = 0
        for req, (prefix, extend) in enumerate(zip(i.chunk.prefix_lens, i.chunk.extend_lens)):
            store.write(layer, i.batch.request_locs[req][prefix : prefix + extend], kv_seq[start : start + extend])
            start += extend
        out = torch.empty_like(x)
        for req, locs in enumerate(i.batch.request_locs):
            # Every rank builds every request's view (a collective), also where it holds none of its queries.
            keys = store.view(layer, locs[: i.chunk.prefix_lens[req] + i.chunk.extend_lens[req]])
            rows = [n for n, (r, _) in enumerate(self.local) if r == req]
            if rows:
                ends = torch.tensor([self.local[n][1] + 1 for n in rows])
                out[rows] = block.attend(x[rows], keys, ends)
        self.transient_bytes = kv_seq.numel() * 4
        return x + out, torch.empty(len(x), 0, dtype=torch.int32)  # no selection

    def end(self) -> None:
        pass

    def prefetch_wait_ms(self) -> list[float]:
        return []


class ToyFamily:
    name = "toy-mla"
    title = "plain MLA without an indexer (a test's family)"
    config_type = ToyConfig
    presets = {TOY: ToyConfig()}
    per_layer_tags = ("kv", "toy_view")
    planner_command = "none"

    def model_for_run(self, cfg: ToyConfig, run: RunConfig) -> ToyConfig:
        return cfg

    def check_run(self, run: RunConfig) -> None:
        if run.kv_design != "phases":
            raise ri.ConfigError(f"kv_design={run.kv_design}: {run.preset} runs under the phases only")

    def weight_bytes(self, cfg: ToyConfig, dtype_bytes: int) -> tuple[int, int]:
        n = cfg.n_layers * (cfg.dim * cfg.kv_dim * (2 * cfg.n_heads + 1)) + cfg.dim * cfg.vocab_size
        return n * dtype_bytes, n * 4

    def estimate(
        self, run: RunConfig, device_type: str, start_method: str, cuda_devices: int, extra_process: int, b: int
    ) -> Footprint:
        rank = int(SAFETY * (PROCESS_BASE["spawn"] + 64 * sum(r.total for r in run.requests) * run.model.dim * 4))
        return Footprint((rank,) * run.cp_size, rank, rank, rank * (run.cp_size + 1), device_type, run.cp_size)

    def build_model(
        self,
        cfg: ToyConfig,
        dtype: torch.dtype,
        seed: int,
        device: torch.device,
        kernels: bool,
        fp8_projections: bool = False,
    ) -> ToyModel:
        torch.manual_seed(seed)
        with torch.device(device):
            return ToyModel(cfg).to(dtype).eval()

    def load_weights(self, model: nn.Module, checkpoint: Any, first_layer: int, head: bool) -> None:
        model.load_state_dict(checkpoint)

    def make_store(self, run: RunConfig, batch: BatchLocs, group: CPGroup) -> ToyStore:
        return ToyStore(run, batch, group)

    def install_prefixes(
        self,
        run: RunConfig,
        model: nn.Module,
        inputs: list[torch.Tensor],
        store: ToyStore,
        chunk: Any,
        shared_tokens: dict[int, int],
    ) -> None:
        for i, req in enumerate(chunk.requests):
            prefix = run.requests[req].prefix
            if prefix:
                oracle = self.oracle(model, [0], [inputs[req][:prefix]], "", 0, None, torch.float32)
                for layer, caches in enumerate(oracle.caches):
                    store.write(layer, store.batch.request_locs[i][:prefix], caches[0])

    def chunk_step(self, inputs: ChunkInputs) -> ToyStep:
        return ToyStep(inputs)

    @torch.no_grad()
    def oracle(
        self,
        model: nn.Module,
        prefixes: Sequence[int],
        inputs: list[torch.Tensor],
        kv_dtype: str,
        page_size: int,
        chunk_size: int | None,
        view_dtype: torch.dtype,
    ) -> ToyOracle:
        hidden, caches = [], [[] for _ in model.layers]
        for prefix, x in zip(prefixes, inputs):
            for layer, block in enumerate(model.layers):
                keys = block.wkv(x)
                caches[layer].append(keys.float())
                x = x + block.attend(x, keys, torch.arange(1, len(x) + 1))
            hidden.append(x[prefix:].float())
        return ToyOracle(hidden, caches)

    def compare(
        self,
        run: RunConfig,
        meta: Any,
        model: nn.Module,
        oracle: ToyOracle,
        results: list[Any],
        compute_dtype: torch.dtype,
    ) -> Agreement:
        problems: list[str] = []
        err, logits_err = compare_outputs(meta, model, torch.cat(oracle.hidden), results, EXACT_TOLERANCE, problems)
        cache_err = 0.0
        for layer in range(run.model.n_layers):
            for req in range(len(run.requests)):
                want = oracle.caches[layer][req]
                got = torch.full_like(want, float("nan"))
                for r in results:
                    positions, rows = r.stored[layer][req]
                    got[positions] = rows
                cache_err = max(cache_err, float((got - want).abs().max()))
        cache_ok = cache_err <= 1e-5  # float32 rows, each rank's GEMM over other rows than the oracle's
        if not cache_ok:
            problems.append(f"cache rows differ (max abs err {cache_err:.3g})")
        return Agreement(not problems, err, logits_err, 1.0, 0, cache_ok, cache_err, problems)

    def report_fields(self, run: RunConfig, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
        return {"attention_kernel": "toy-dense", "index_topk_pattern": None, "selects": False}

    def check_pd(self, run: RunConfig) -> None:
        raise ri.ConfigError(f"{run.preset}: no PD transfer")

    def decode_bytes(self, run: RunConfig) -> int:
        return 0

    def pd_payload(self, run: RunConfig) -> None:
        return None  # check_pd refuses PD first


TOY_FAMILY = ToyFamily()


@pytest.fixture
def toy_family(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    """The toy family, named in ``DSACP_FAMILIES``: this process's registry loads it when next used, and so
    do the rank processes (forks or not)."""
    monkeypatch.setenv("DSACP_FAMILIES", f"{__name__}:TOY_FAMILY")
    assert families.family_of(ToyConfig()) is TOY_FAMILY
    yield TOY_FAMILY
    families.unregister(TOY_FAMILY.name)
    monkeypatch.delenv("DSACP_FAMILIES")


def test_register_adds_a_family_in_this_process() -> None:
    family = ToyFamily()
    family.name, family.presets = "toy-copy", {"toy-copy": ToyConfig(name="toy-copy")}
    families.register(family)
    try:
        assert ri.get_preset("toy-copy").name == "toy-copy" and "toy-copy" in ri.PRESETS
    finally:
        families.unregister("toy-copy")
    assert "toy-copy" not in ri.PRESETS


@pytest.mark.parametrize(("level", "cp_size"), [(0, 2), (2, 2), (2, 3), (3, 3)])
def test_a_family_defined_in_a_test_runs_through_the_engine(toy_family: ToyFamily, level: int, cp_size: int) -> None:
    """Unaligned requests, a cached prefix and chunks: the engine's report matches the toy oracle, and
    phase 2 keeps each row on one rank."""
    run = RunConfig(
        preset=TOY,
        cp_size=cp_size,
        phases=PhaseSet.level(level),
        page_size=4,
        chunk_size=7,
        requests=(Request(5, 13), Request(0, 9)),
        device="cpu",
    )
    report = ri.run_prefill(run)
    assert report["matches_oracle"], report["problems"]
    held = [r["kv_bytes"] for r in report["per_rank"]]
    row_bytes = run.model.n_layers * run.model.kv_dim * 4
    tokens = sum(r.total for r in run.requests)
    if level >= 2:
        assert sum(held) == tokens * row_bytes  # every row on exactly one rank
    else:
        assert held == [tokens * row_bytes] * cp_size


def test_the_toy_check_fails_on_a_wrong_store(toy_family: ToyFamily, monkeypatch: pytest.MonkeyPatch) -> None:
    """The family's comparison can fail: a store that writes every row twice as large is caught."""
    real = ToyStore.write
    monkeypatch.setattr(ToyStore, "write", lambda self, layer, locs, rows: real(self, layer, locs, 2 * rows))
    run = RunConfig(
        preset=TOY, cp_size=2, phases=PhaseSet.level(2), page_size=4, requests=(Request(0, 11),), device="cpu"
    )
    monkeypatch.setenv("DSACP_RANK_THREADS", "1")  # fork: the patched store reaches the ranks
    assert not ri.run_prefill(run)["matches_oracle"]


# ---- the registry and the types ----------------------------------------------------------------


def test_every_preset_is_listed_with_its_familys_config() -> None:
    listed = ri.PRESETS
    assert {"deepseek-v3.2", "glm-5", "glm-5.2", "tiny", "deepseek-v4-flash", "deepseek-v4-pro", "tiny-v4"} <= set(
        listed
    )
    for name, cfg in listed.items():
        family = families.family_of(cfg)
        assert type(cfg) is family.config_type and family.presets[name] is cfg and ri.get_preset(name) is cfg


def test_a_registered_family_is_listed_and_can_leave(toy_family: ToyFamily) -> None:
    assert TOY in ri.PRESETS and families.family_of(ri.get_preset(TOY)) is toy_family
    with pytest.raises(ri.ConfigError, match="registered already"):
        families.register(toy_family)


def test_a_bad_plugin_spec_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSACP_FAMILIES", "no_such_module:FAMILY")
    with pytest.raises(ri.ConfigError, match="DSACP_FAMILIES='no_such_module:FAMILY': cannot load it"):
        families.all_presets()


def _stores() -> list[tuple[str, Any]]:
    """Every store the engine builds, for a tiny run per family, level and design."""
    from reference_impl.cp.loopback import LoopbackGroup
    from reference_impl.engine import chunk_metadata, new_run_page_table, replay_page_table, run_id_space
    from reference_impl.schedule import chunk_schedule

    out = []
    runs = [RunConfig(preset="tiny", phases=PhaseSet.level(level), device="cpu") for level in (0, 2, 5, 8)]
    runs += [
        RunConfig(preset="tiny", kv_design=d, phases=PhaseSet.level(1), device="cpu")
        for d in ("layer-split", "rotated-shard", "dcp-gather")
    ]
    runs += [RunConfig(preset="tiny-v4", phases=PhaseSet.level(level), device="cpu") for level in (0, 2)]
    for run in runs:
        chunk = chunk_schedule(run)[0]
        table = new_run_page_table(run)
        batch = BatchLocs.build(
            chunk_metadata(run, chunk),
            "cpu",
            run.phases.compute_owner,
            table=table,
            request_ids=chunk.requests,
            id_space=run_id_space(replay_page_table(run)),
        )
        out.append(
            (
                f"{run.preset} {run.kv_design} level {max(run.phases.enabled, default=0)}",
                run.family.make_store(run, batch, LoopbackGroup(0, run.cp_size, torch.device("cpu"))),
            )
        )
    return out


def test_every_store_keeps_the_store_protocol() -> None:
    from reference_impl.cp.kv_store import KVStore

    for name, store in _stores():
        assert isinstance(store, RankStore), name
        assert isinstance(store.kv_bytes, int) and isinstance(store.breakdown(), dict), name
        if run_is_dsa := not hasattr(store, "entry_owner"):  # the DSA family's stores: the layer operations too
            missing = [
                m for m in ("store_current", "full_view", "write_prefix", "stored_rows") if not hasattr(store, m)
            ]
            assert run_is_dsa and not missing, f"{name}: no {missing} ({KVStore.__name__})"


# ---- orchestration names no family --------------------------------------------------------------

ORCHESTRATION = (
    "engine",
    "runner",
    "launch",
    "rank_processes",
    "api",
    "report",
    "footprint",
    "config",
    "cli",
    "workload",
    "prefill_decode",
    "schedule",
    "demo",
    "__init__",
    "__main__",
)
SHARED = ("cp", "kvcache", "kernels", "model", "pd")  # the CP machinery and the layer base every family reuses


def _imported(path: Path) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            found += [(f"{node.module}.{a.name}", node.lineno) for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
    return found


def _outside_families() -> list[Path]:
    modules = [PACKAGE / f"{name}.py" for name in ORCHESTRATION]
    modules += [p for part in SHARED for p in (PACKAGE / part).rglob("*.py")]
    return [p for p in modules if p.exists()]


def test_no_module_outside_a_family_imports_one() -> None:
    """The registry (``reference_impl.families`` and its ``base``) is the only door into the families."""
    bad = [
        f"{p.relative_to(PACKAGE)}:{line} imports {name}"
        for p in _outside_families()
        for name, line in _imported(p)
        if name.startswith("reference_impl.families.") and name.split(".")[2] not in ("base", *families.__all__)
    ]
    assert not bad, bad


def test_no_module_outside_a_family_tests_which_family_it_runs() -> None:
    """No ``is_v4``, no family's config type in an ``isinstance``, no preset name compared with a literal."""
    family_types = {e.config_type.__name__ for e in families._entries().values()}
    presets = set(families.preset_names())
    bad = []
    for path in _outside_families():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            where = f"{path.relative_to(PACKAGE)}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Name) and node.id in ("is_v4", *family_types - {"ModelConfig"}):
                bad.append(f"{where}: {node.id}")
            if isinstance(node, ast.Compare) and any(
                isinstance(c, ast.Constant) and c.value in presets for c in (node.left, *node.comparators)
            ):
                bad.append(f"{where}: compares with a preset name")
    assert not bad, bad


def test_the_graph_checks_can_fail(tmp_path: Path) -> None:
    fake = tmp_path / "engine.py"
    fake.write_text("from reference_impl.families.deepseek_v4.config import is_v4\nif run.preset == 'tiny-v4': pass\n")
    assert any(n.startswith("reference_impl.families.deepseek_v4") for n, _ in _imported(fake))
    compares = [n for n in ast.walk(ast.parse(fake.read_text())) if isinstance(n, ast.Compare)]
    assert compares and compares[0].comparators[0].value in families.preset_names()  # type: ignore[attr-defined]
