"""PD over the Mooncake Transfer Engine: one-sided writes into the decode's registered pool.

In one process (two engines over TCP on loopback): a block written by
:class:`~reference_impl.pd.mooncake.MooncakeTransport` lands byte for byte where the two-sided
receive would put it, the completion books every row once, a missing completion or a write outside
the registered pool is an error that names it. End to end (``pd --transport mooncake``): the
decode matches the oracle, bytes sent equal the bytes at rest, with chunked prefill and several
batches. Mooncake must import here: where ``scripts/setup.sh`` could not install it, it recorded
why (:data:`scripts.ensure_deps.MOONCAKE_MARKER`), and these tests skip with that reason unless
``DSACP_REQUIRE_MOONCAKE=1`` (CI) makes them fail.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from reference_impl.cli import main
from reference_impl.config import ConfigError, PhaseSet, Request, RunConfig, env_flag, get_preset, parse_batches
from reference_impl.kvcache.layout import KVLayout
from reference_impl.pd.dcp import DcpDecodeShard, DcpLayout
from reference_impl.pd.mooncake import (
    Completion,
    MooncakeReceiver,
    MooncakeTransport,
    TransferTimeoutError,
    merge_runs,
    position_runs,
)
from reference_impl.pd.mooncake_engine import MooncakeEngine, MooncakeError, installed_protocol, mooncake_unavailable
from reference_impl.pd.transport import RowBlock
from reference_impl.prefill_decode import run_prefill_and_decode

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("ensure_deps", ROOT / "scripts" / "ensure_deps.py")
ensure_deps = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ensure_deps)


def require_mooncake() -> None:
    """Mooncake imports, or setup recorded why it could not install it (then skip, unless required)."""
    reason = mooncake_unavailable()
    if reason is None:
        return
    marker = ensure_deps.MOONCAKE_MARKER
    if env_flag("require_mooncake"):
        pytest.fail(f"DSACP_REQUIRE_MOONCAKE=1 and {reason}")
    if not marker.exists():
        pytest.fail(f"{reason}, and scripts/setup.sh recorded no reason it could not install it: run it")
    pytest.skip(f"setup could not install Mooncake: {marker.read_text().strip()}")


# ---- setup -------------------------------------------------------------------------------------


def test_setup_records_why_it_could_not_install_mooncake(monkeypatch, tmp_path, capsys) -> None:
    """Not root and the RDMA libraries missing: one line, the reason kept for the tests' skip;
    required (CI), the same is an error; once it imports, the record goes."""
    marker = tmp_path / "marker"
    monkeypatch.setattr(ensure_deps, "MOONCAKE_MARKER", marker)
    monkeypatch.setattr(ensure_deps, "mooncake_import_error", lambda: "ImportError: libibverbs.so.1: cannot open")
    monkeypatch.setattr(ensure_deps, "installed_version", lambda name: "0.3.13")  # some build is installed
    monkeypatch.setattr(ensure_deps, "_missing_debian_libs", lambda: ["libibverbs1"])
    monkeypatch.setattr(ensure_deps.os, "geteuid", lambda: 1000)
    monkeypatch.delenv("DSACP_REQUIRE_MOONCAKE", raising=False)
    assert ensure_deps.ensure_mooncake([], dry_run=False) == 0
    assert "needs the Debian packages libibverbs1" in marker.read_text()
    assert capsys.readouterr().err.count("\n") == 1  # one line
    monkeypatch.setenv("DSACP_REQUIRE_MOONCAKE", "1")
    assert ensure_deps.ensure_mooncake([], dry_run=False) == 1
    monkeypatch.setenv("DSACP_REQUIRE_MOONCAKE", "maybe")
    with pytest.raises(SystemExit, match="DSACP_REQUIRE_MOONCAKE='maybe'"):
        ensure_deps.ensure_mooncake([], dry_run=False)
    monkeypatch.setattr(ensure_deps, "mooncake_import_error", lambda: None)
    monkeypatch.setenv("DSACP_REQUIRE_MOONCAKE", "1")
    assert ensure_deps.ensure_mooncake([], dry_run=False) == 0 and not marker.exists()


# ---- pure helpers (no engine) ------------------------------------------------------------------


def test_runs_merge_adjacent_destinations_only() -> None:
    src = torch.tensor([100, 104, 108, 112])
    assert merge_runs(src, torch.tensor([0, 4, 8, 20]), 4) == ([100, 112], [0, 20], [12, 4])
    assert merge_runs(src[:0], src[:0], 4) == ([], [], [])
    assert position_runs(torch.tensor([16, 17, 18, 48, 49, 3])) == [[16, 3], [48, 2], [3, 1]]


def test_a_completion_survives_its_message() -> None:
    done = Completion(2, 1, (0, 1), 5, 660, ((16, 3), (48, 2)))
    again = Completion.parse(done.message())
    assert again == done and again.positions().tolist() == [16, 17, 18, 48, 49]


def test_the_protocol_is_what_the_topology_lists(monkeypatch) -> None:
    assert installed_protocol('{"cpu:0": [[], []]}') == "tcp"
    assert installed_protocol('{"cpu:0": [["mlx5_0"], []]}') == "rdma"
    monkeypatch.setenv("MC_FORCE_TCP", "1")
    assert installed_protocol('{"cpu:0": [["mlx5_0"], []]}') == "tcp"


# ---- one process, two engines ------------------------------------------------------------------

N_LAYERS, PAGE = 2, 16
TOTALS = (37, 20)  # request lengths: partial last pages


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[MooncakeEngine, MooncakeEngine]]:
    """Two engines in this process for the module's tests, destroyed here when the module ends.

    Left to the garbage collector (the frames of a refused write keep them referenced), they could
    outlive the module: a later test that forks CP ranks copies them, and a rank whose collector
    frees its copy runs the engine's destructor, which joins threads that exist only in this process,
    and the rank hangs (seen in a shuffled run: ``test_bench_ranks`` after this module)."""
    require_mooncake()
    pair = (MooncakeEngine.start(), MooncakeEngine.start())
    yield pair
    for engine in pair:
        engine.destroy()  # the native engine's last reference: its destructor runs now, in this process
    gc.collect()


def _shard() -> DcpDecodeShard:
    layout = KVLayout.from_config(get_preset("tiny"), "fp8", PAGE)
    shard = DcpDecodeShard(0, DcpLayout(1, 1), layout, N_LAYERS, sum(-(-n // PAGE) for n in TOTALS) + 1, "cpu")
    shard.admit(0, 5)  # a request before these: their slots do not start at 0
    for req, n in enumerate(TOTALS, start=1):
        shard.admit(req, n)
    return shard


def _block(req: int, layer: int, positions: torch.Tensor, shard: DcpDecodeShard, seed: int) -> RowBlock:
    g = torch.Generator().manual_seed(seed)
    n, layout = positions.numel(), shard.kv_layout
    return RowBlock(
        req,
        layer,
        positions,
        torch.randint(0, 256, (n, layout.mla_bytes), dtype=torch.uint8, generator=g),
        torch.randint(0, 256, (n, layout.index_head_dim), dtype=torch.uint8, generator=g),
        torch.rand(n, generator=g),
    )


def test_one_sided_writes_land_where_a_receive_puts_the_rows(engines) -> None:
    prefill, decode = engines
    shard, reference = _shard(), _shard()
    receiver = MooncakeReceiver(shard, decode, range(3))
    transport = MooncakeTransport(prefill, receiver.target, rank=0)
    requests = {
        1: torch.cat([torch.arange(16, 32), torch.arange(0, 16), torch.arange(32, 37)]),  # pages out of order
        2: torch.arange(20),
    }
    sent = 0
    for req, positions in requests.items():
        for layer in range(N_LAYERS):
            block = _block(req, layer, positions, shard, seed=10 * req + layer)
            transport.isend(block, 0).wait()
            reference.receive(block)
            sent += block.payload_bytes
        transport.complete(req, 0).wait()
    for layer in range(N_LAYERS):  # this rank holds no row of request 0: blocks without rows, then its completion
        transport.isend(_block(0, layer, torch.zeros(0, dtype=torch.long), shard, 0), 0).wait()
    transport.complete(0, 0).wait()
    done = receiver.wait(range(3), [0], N_LAYERS, deadline_s=30)
    transport.close()
    receiver.close()
    assert torch.equal(shard.pool.mla, reference.pool.mla) and torch.equal(shard.pool.index, reference.pool.index)
    assert shard.bytes_received == reference.bytes_received == transport.bytes_written == sent
    assert sorted((d.request, d.rows) for d in done) == [(0, 0), (1, 37), (2, 20)]
    # Request 2's slots are adjacent: one MLA piece, and one index and one scale piece per decode page.
    assert [t.pieces for t in transport.timings if t.request == 2] == [1 + 2 + 2] * N_LAYERS
    with pytest.raises(ConfigError, match="a row arrived twice"):  # the exactly-once booking
        shard.landed(2, torch.arange(3), [0], 0)


def test_a_missing_completion_is_named_at_the_deadline(engines) -> None:
    _, decode = engines
    receiver = MooncakeReceiver(_shard(), decode, range(3))
    with pytest.raises(TransferTimeoutError, match="request 1 from prefill rank 0"):
        receiver.wait([1], [0], N_LAYERS, deadline_s=0.2)
    receiver.close()


def test_a_write_outside_the_registered_pool_fails(engines) -> None:
    prefill, decode = engines
    shard = _shard()
    receiver = MooncakeReceiver(shard, decode, range(3))
    target = receiver.target
    unregistered = torch.zeros_like(shard.pool.mla)  # the same geometry, memory the decode did not register
    beyond = type(target)(**{**target.__dict__, "mla_address": unregistered.data_ptr()})
    transport = MooncakeTransport(prefill, beyond, rank=0)
    with pytest.raises(MooncakeError, match="returned -1"):
        transport.isend(_block(2, 0, torch.arange(4), shard, 0), 0).wait()
    with pytest.raises(ConfigError, match="beyond the 20 the decode allocated"):
        transport.isend(_block(2, 0, torch.arange(21), shard, 0), 0).wait()
    transport.close()
    receiver.close()
    assert not unregistered.any()


# ---- end to end --------------------------------------------------------------------------------


def _pd_json(capsys, argv: list[str]) -> dict:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(
    "extra", [["--phases", "5"], ["--phases", "8", "--chunk-size", "70"]], ids=["level5", "level8-chunked"]
)
def test_the_pd_command_over_mooncake_matches_the_oracle(capsys, extra: list[str]) -> None:
    require_mooncake()
    doc = _pd_json(
        capsys,
        [
            "pd",
            "--transport",
            "mooncake",
            "--cp-size",
            "2",
            "--requests",
            "130+300,0+200",
            "--page-size",
            "16",
            "--json",
            *extra,
        ],
    )
    assert doc["decode_matches_oracle"] is True and doc["decode_matches_prefill"] is True, doc["problems"]
    assert doc["transport"] == "mooncake" and doc["protocol"] in ("tcp", "rdma")
    ranks = doc["prefill_ranks"]
    assert all(r["bytes_sent"] == r["bytes_at_rest"] > 0 and r["protocol"] == doc["protocol"] for r in ranks)
    assert doc["bytes_received"] == sum(r["bytes_sent"] for r in ranks)


def test_several_batches_over_mooncake() -> None:
    require_mooncake()
    requests, sizes = parse_batches("0+40,21+30;r0:32+20,5+9")
    run = RunConfig(
        preset="tiny",
        cp_size=3,
        requests=tuple(requests),
        batch_sizes=sizes,
        page_size=16,
        phases=PhaseSet.level(6),
        device="cpu",
    )
    result = run_prefill_and_decode(run, transfer="rows", transport="mooncake")
    assert result.matches_oracle, result.problems
    assert all(s.bytes_sent == s.bytes_at_rest > 0 for s in result.sent)
    assert result.bytes_received == sum(s.bytes_sent for s in result.sent)


def test_transport_refusals(capsys, monkeypatch) -> None:
    run = RunConfig(
        preset="tiny", cp_size=2, requests=(Request(0, 40),), page_size=16, phases=PhaseSet.level(2), device="cpu"
    )
    with pytest.raises(ConfigError, match="transport='nccl'"):
        run_prefill_and_decode(run, transfer="rows", transport="nccl")
    with pytest.raises(ConfigError, match="use transfer='rows'"):
        run_prefill_and_decode(run, transfer="pages", transport="mooncake")
    assert main(["pd", "--transport", "ucx"]) == 2
    assert "--transport='ucx'" in capsys.readouterr().err
    monkeypatch.setenv("DSACP_TRANSPORT", "")
    assert main(["pd"]) == 2
    assert "DSACP_TRANSPORT=''" in capsys.readouterr().err
    monkeypatch.setattr("reference_impl.prefill_decode.mooncake_unavailable", lambda: "no mooncake here")
    with pytest.raises(ConfigError, match="no mooncake here"):
        run_prefill_and_decode(run, transfer="rows", transport="mooncake")


# ---- the H200 measurement's command, on CPU ----------------------------------------------------


def test_the_mooncake_bench_dry_run_checks_what_arrived(tmp_path) -> None:
    from reference_impl.bench import pd_mooncake

    require_mooncake()
    out = tmp_path / "dry.json"
    assert (
        pd_mooncake.main(
            [
                "--out",
                str(out),
                "--device",
                "cpu",
                "--preset",
                "tiny",
                "--cp-size",
                "2",
                "--workloads",
                "t:32+200",
                "--layers",
                "2",
                "--repeats",
                "1",
                "--no-end-to-end",
            ]
        )
        == 0
    )
    doc = json.loads(out.read_text())
    assert doc["ok"] and doc["failure"] is None and doc["mooncake"]["protocol"] in ("tcp", "rdma")
    w = doc["workloads"][0]
    assert set(w["layer_ms"]) == {"plain", "torch", "mooncake_host"} and not w["variant_errors"]
    assert w["mooncake_host"]["received_equal_rows_at_rest"] is True
    assert w["mooncake_host"]["bytes_per_layer"] > 0 and w["mooncake_host"]["pieces_per_layer"] >= 3


def test_the_mooncake_bench_records_a_wheel_that_does_not_load(tmp_path, monkeypatch) -> None:
    from reference_impl.bench import pd_mooncake

    monkeypatch.setattr(pd_mooncake, "load_mooncake", lambda dirs: ("ImportError: libibverbs.so.1: cannot open", []))
    out = tmp_path / "failed.json"
    assert pd_mooncake.main(["--out", str(out), "--device", "cpu"]) == 0  # recorded, not a crash
    doc = json.loads(out.read_text())
    assert doc["ok"] is False and doc["failure"]["stage"] == "load" and "libibverbs" in doc["failure"]["error"]


def test_the_bench_loads_a_missing_library_from_the_folders_given(tmp_path, monkeypatch) -> None:
    """What the wheel misses is loaded from ``--libs`` (only that), and child processes find it."""
    from reference_impl.bench import pd_mooncake

    libc = Path(ctypes_util_find("m"))
    (tmp_path / "deb" / "usr" / "lib").mkdir(parents=True)
    fake = tmp_path / "deb" / "usr" / "lib" / "libdsacpfake.so.1"
    fake.write_bytes(libc.read_bytes())
    answers = iter(["ImportError: libdsacpfake.so.1: cannot open shared object file: No such file", None])
    monkeypatch.setattr(pd_mooncake, "mooncake_unavailable", lambda: next(answers))
    monkeypatch.setenv("LD_LIBRARY_PATH", "")
    monkeypatch.setattr(pd_mooncake, "LIB_LINKS", tmp_path / "links")
    error, loaded = pd_mooncake.load_mooncake([str(tmp_path / "deb")])
    assert error is None and loaded == [str(fake)]
    assert (Path(os.environ["LD_LIBRARY_PATH"].split(":")[0]) / fake.name).resolve() == fake.resolve()
    monkeypatch.setattr(
        pd_mooncake, "mooncake_unavailable", lambda: "ImportError: libnowhere.so.3: cannot open shared object file"
    )
    assert pd_mooncake.load_mooncake([str(tmp_path / "deb")]) == (
        "ImportError: libnowhere.so.3: cannot open shared object file",
        [],
    )


def ctypes_util_find(name: str) -> str:
    import ctypes.util

    found = ctypes.util.find_library(name)
    assert found is not None
    for folder in ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64", "/usr/lib64", "/lib", "/usr/lib"):
        if (Path(folder) / found).exists():
            return str(Path(folder) / found)
    pytest.skip(f"{found} not found in the usual folders")
