"""The layer-wise PD send through the Mooncake Transfer Engine, beside the torch transport, on one GPU.

Usage::

    python -m reference_impl.bench.pd_mooncake --out docs/results/pd_mooncake_h200.json [--libs DIR ...]
        [--cp-size 8] [--rank 0] [--level 8] [--layers 4] [--repeats 3] [--wire-gbps 450]
        [--workloads 32k:0+32768,128k:0+131072,prefix-heavy:131072+2048]
    python -m reference_impl.bench.pd_mooncake --out dry.json --device cpu --preset tiny --cp-size 2 \\
        --workloads t:0+256 --layers 2 --repeats 1        # CPU dry run

One process plays prefill rank ``--rank`` of ``--cp-size`` (:class:`~reference_impl.cp.loopback.LoopbackGroup`,
as :mod:`reference_impl.bench.pd_stream` does) and the decode. Per workload (one request), the
runs of each repeat alternate between four variants:

* ``plain``: the prefill alone;
* ``torch``: the layer-wise send over :class:`~reference_impl.pd.transport.InProcessTransport`: the
  device leg only (pool read and copy to pinned host memory on a side stream); gloo's network leg
  needs a second process and is not run here;
* ``mooncake_host``: the same staging, then :class:`~reference_impl.pd.mooncake.MooncakeTransport`
  writes every block into a decode pool in host memory registered with a second engine in this
  process (TCP on one machine, RDMA where Mooncake finds a device), and the decode waits for the
  completion;
* ``mooncake_gpu``: the same into a decode pool in GPU memory, registered directly (the CUDA
  build's TCP transport copies into it with ``cudaMemcpy``; RDMA would write it with GPUDirect).

Reported per variant: the layer time (median over the layers after the first; ``added_paired``:
the median over repeats of each run's difference from the plain run of the same repeat); for the
Mooncake variants the network leg (each block's copy into the send buffer plus its write, on the
sender thread), how much of it ended before the layer loop did (host clock; the loop's end is its
CUDA event's completion), how long the last write and the completion landed after it, and whether
the decode's rows equal the rows the rank holds at rest. Then an end-to-end run of
``pd --transport mooncake`` (C = 2 prefill processes and a decode sharing the device, tiny preset,
level 8, chunked): its verdict and protocol.

``--libs DIR``: folders holding shared libraries the Mooncake wheel links and the machine lacks
(``libibverbs.so.1``, ``libmlx5.so.1``, ``libnuma.so.1``, ``libcurl.so.4``, unpacked from Debian
packages with ``dpkg -x``): each missing one is loaded from there, and only those. If Mooncake
cannot be loaded or a step fails, the JSON records what failed (``ok: false``, ``failure``) and the
command still exits 0.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.metadata as metadata
import json
import os
import platform
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from reference_impl.bench.layer import Workload
from reference_impl.bench.pd_stream import DECODE_RANK, parse_stream_args, runs_fit, stream_parser, streamed_prefill
from reference_impl.bench.record import run_record
from reference_impl.config import ConfigError, PhaseSet, Request, RunConfig
from reference_impl.cp.loopback import LoopbackGroup
from reference_impl.engine import request_locs, run_rank
from reference_impl.kvcache.layout import KVLayout
from reference_impl.pd.dcp import DcpDecodeShard, DcpLayout
from reference_impl.pd.mooncake import MooncakeReceiver, MooncakeTransport
from reference_impl.pd.mooncake_engine import MooncakeEngine, mooncake_unavailable
from reference_impl.pd.stream import LayerStreamer
from reference_impl.tool_args import refusing

PROG = "python -m reference_impl.bench.pd_mooncake"
LIB_LINKS = Path(tempfile.gettempdir()) / "dsacp-mooncake-libs"  # the loaded ones, for LD_LIBRARY_PATH
MISSING_LIB = re.compile(r"(lib[\w.+-]+\.so[\w.]*): cannot open shared object file")
VARIANTS = ("plain", "torch", "mooncake_host", "mooncake_gpu")


# ---- loading the wheel ------------------------------------------------------------------------


def _find(soname: str, dirs: list[Path]) -> Path | None:
    for d in dirs:
        for path in d.rglob(soname):
            return path
    return None


def _preload(path: Path, dirs: list[Path], loaded: list[str], depth: int = 0) -> None:
    """Load ``path`` globally, first loading from ``dirs`` whatever it misses (depth-first)."""
    for _ in range(32):
        try:
            ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
            loaded.append(str(path))
            return
        except OSError as exc:
            missing = MISSING_LIB.search(str(exc))
            dep = _find(missing.group(1), dirs) if missing and depth < 8 else None
            if dep is None:
                raise
            _preload(dep, dirs, loaded, depth + 1)


def load_mooncake(lib_dirs: list[str]) -> tuple[str | None, list[str]]:
    """Import ``mooncake.engine``, loading each shared library it misses from ``lib_dirs`` (and
    the CUDA runtime libraries that came with torch); ``(error or None, paths loaded)``. The
    loaded libraries are also linked into :data:`LIB_LINKS`, put on ``LD_LIBRARY_PATH`` for child
    processes (and for a later command: ``LD_LIBRARY_PATH=/tmp/dsacp-mooncake-libs``)."""
    dirs = [Path(d) for d in lib_dirs] + [Path(torch.__file__).resolve().parent.parent / "nvidia"]
    dirs = [d for d in dirs if d.is_dir()]
    loaded: list[str] = []
    error = mooncake_unavailable()
    for _ in range(32):
        if error is None:
            break
        missing = MISSING_LIB.search(error)
        path = _find(missing.group(1), dirs) if missing else None
        if path is None:
            return error, loaded
        try:
            _preload(path, dirs, loaded)
        except OSError as exc:
            return f"{error}; loading {path} failed: {exc}", loaded
        error = mooncake_unavailable()
    if loaded:
        shutil.rmtree(LIB_LINKS, ignore_errors=True)
        LIB_LINKS.mkdir(parents=True)
        for p in loaded:
            (LIB_LINKS / Path(p).name).symlink_to(p)
        os.environ["LD_LIBRARY_PATH"] = f"{LIB_LINKS}:{os.environ.get('LD_LIBRARY_PATH', '')}".rstrip(":")
    return error, loaded


def mooncake_distribution() -> str | None:
    for name in ("mooncake-transfer-engine-cuda13", "mooncake-transfer-engine", "mooncake-transfer-engine-non-cuda"):
        try:
            return f"{name}=={metadata.version(name)}"
        except metadata.PackageNotFoundError:
            continue
    return None


# ---- one run of each variant -----------------------------------------------------------------


class _TimedStreamer(LayerStreamer):
    """A :class:`LayerStreamer` that also notes, on the host clock, when the layer loop's last
    kernel finished (a watcher thread waits for the loop's CUDA event; on CPU: at once)."""

    loop_end_host: float | None = None

    def loop_done(self) -> None:
        super().loop_done()
        if self.loop_end is None:
            self.loop_end_host = time.perf_counter()
            return
        event = self.loop_end

        def watch() -> None:
            event.synchronize()
            self.loop_end_host = time.perf_counter()

        self._watcher = threading.Thread(target=watch, daemon=True)
        self._watcher.start()

    def loop_end_time(self) -> float:
        watcher = getattr(self, "_watcher", None)
        if watcher is not None:
            watcher.join()
        assert self.loop_end_host is not None
        return self.loop_end_host


def _rows_equal(run: RunConfig, result: Any, shard: DcpDecodeShard) -> bool:
    locs = request_locs(run)[0].to(result.store.pool.device)
    for layer in range(run.model.n_layers):
        positions, mla, index, scale = result.store.stored_rows(layer, [locs])[0]
        slots = shard.locs(0, positions).to(shard.pool.device)
        k_fp8, k_scale = shard.pool.read_index(layer, slots)
        got = (shard.pool.read_mla(layer, slots), k_fp8.view(torch.uint8), k_scale)
        if not all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(got, (mla, index, scale))):
            return False
    return True


def mooncake_run(
    run: RunConfig, group: LoopbackGroup, engines: tuple[MooncakeEngine, MooncakeEngine], decode_device: str
) -> dict[str, Any]:
    """One prefill whose layer-wise send goes through Mooncake into a decode pool on ``decode_device``."""
    prefill_engine, decode_engine = engines
    layout = KVLayout.from_config(run.model, run.kv_dtype, run.page_size)
    n_tokens, n_layers = run.requests[0].total, run.model.n_layers
    shard = DcpDecodeShard(0, DcpLayout(1, 1), layout, n_layers, -(-n_tokens // run.page_size), decode_device)
    shard.admit(0, n_tokens)
    receiver = MooncakeReceiver(shard, decode_engine, [0])
    transport = MooncakeTransport(prefill_engine, receiver.target, group.rank)
    streamer = _TimedStreamer(transport, DECODE_RANK)
    result = run_rank(group, run, keep_store=True, on_layer_stored=streamer)
    returned = time.perf_counter()
    streamer.wait_all()
    receiver.wait([0], [group.rank], n_layers, deadline_s=120)
    done = time.perf_counter()
    transport.close()
    receiver.close()
    loop_end = streamer.loop_end_time()
    legs = transport.timings
    network = sum(t.end - t.start for t in legs)
    hidden = sum(max(0.0, min(t.end, loop_end) - t.start) for t in legs)
    o = streamer.overlap
    return {
        "layer_ms": result.timings["layer_ms"][1:],
        "bytes_per_layer": transport.bytes_written // n_layers,
        "network_ms_per_layer": 1e3 * network / n_layers,
        "pieces_per_layer": sum(t.pieces for t in legs) / n_layers,
        "network_hidden_fraction": hidden / network if network else 1.0,
        "last_write_after_loop_ms": 1e3 * max(0.0, max((t.end for t in legs), default=loop_end) - loop_end),
        "completion_after_loop_ms": 1e3 * max(0.0, done - loop_end),
        "wait_after_prefill_ms": 1e3 * (done - returned),
        "staging_ms_per_layer": o.staging_ms / n_layers if o else None,
        "staging_hidden_fraction": o.hidden_fraction if o else None,
        "received_equal_rows_at_rest": _rows_equal(run, result, shard),
    }


def measure(
    args: argparse.Namespace, workload: Workload, engines: tuple[MooncakeEngine, MooncakeEngine], variants: list[str]
) -> dict[str, Any]:
    """Alternate the variants ``args.repeats`` times on one workload -> JSON-ready dict."""
    run = RunConfig(
        preset=args.preset,
        n_layers=args.layers,
        cp_size=args.cp_size,
        requests=(Request(workload.prefix, workload.extend),),
        check=False,
        device=args.device,
        phases=PhaseSet.level(args.level),
    )
    group_of = lambda: LoopbackGroup(args.rank, args.cp_size, args.device, args.wire_gbps)  # noqa: E731
    decode_device = {"mooncake_host": "cpu", "mooncake_gpu": args.device}
    streamed_prefill(run, group_of())  # warm-up: kernels compiled, pinned host blocks cached
    errors: dict[str, str] = {}
    for v in [v for v in variants if v.startswith("mooncake")]:
        try:
            mooncake_run(run, group_of(), engines, decode_device[v])
        except Exception as exc:  # noqa: BLE001 (recorded: a variant the wheel cannot run)
            errors[v] = f"{type(exc).__name__}: {exc}"
    live = [v for v in variants if v not in errors]
    layer_ms: dict[str, list[float]] = {v: [] for v in live}
    paired: dict[str, list[float]] = {v: [] for v in live if v != "plain"}
    details: dict[str, list[dict[str, Any]]] = {v: [] for v in live if v.startswith("mooncake")}
    torch_legs: list[tuple[float, float, float]] = []
    for _ in range(args.repeats):
        base = run_rank(group_of(), run).timings["layer_ms"][1:]
        layer_ms["plain"] += base
        for v in live[1:]:
            if v == "torch":
                result, streamer, _, _ = streamed_prefill(run, group_of())
                got = result.timings["layer_ms"][1:]
                o = streamer.overlap
                if o is not None:
                    torch_legs.append((o.staging_ms / args.layers, o.hidden_fraction, o.exposed_after_loop_ms))
                del result
            else:
                detail = mooncake_run(run, group_of(), engines, decode_device[v])
                got = detail.pop("layer_ms")
                details[v].append(detail)
            layer_ms[v] += got
            paired[v].append(statistics.median(got) - statistics.median(base))
    med = statistics.median
    out: dict[str, Any] = {
        "workload": workload.__dict__,
        "level": args.level,
        "layer_ms": {v: med(ms) for v, ms in layer_ms.items()},
        "added_paired_ms": {v: med(d) for v, d in paired.items()},
        "samples_per_variant": len(layer_ms["plain"]),
        "variant_errors": errors,
    }
    if torch_legs:
        out["torch"] = {
            "staging_ms_per_layer": med(t[0] for t in torch_legs),
            "staging_hidden_fraction": med(t[1] for t in torch_legs),
            "staging_exposed_ms": med(t[2] for t in torch_legs),
        }
    for v, runs in details.items():
        keys = [k for k in runs[0] if k != "received_equal_rows_at_rest"]
        out[v] = {k: (med(r[k] for r in runs) if runs[0][k] is not None else None) for k in keys}
        out[v]["network_gbps"] = out[v]["bytes_per_layer"] / out[v]["network_ms_per_layer"] / 1e6
        out[v]["received_equal_rows_at_rest"] = all(r["received_equal_rows_at_rest"] for r in runs)
    return out


def end_to_end(device: str) -> dict[str, Any]:
    """``pd --transport mooncake`` on C = 2 prefill processes and a decode (tiny, level 8, chunked)."""
    from reference_impl.prefill_decode import run_prefill_and_decode

    run = RunConfig(
        preset="tiny",
        cp_size=2,
        requests=(Request(130, 300), Request(0, 200)),
        page_size=16,
        phases=PhaseSet.level(8),
        chunk_size=70,
        device=device,
    )
    start = time.perf_counter()
    result = run_prefill_and_decode(run, timeout_s=90, transfer="rows", transport="mooncake")
    return {
        "command": "pd --transport mooncake --cp-size 2 --requests 130+300,0+200 --page-size 16 --phases 8 "
        f"--chunk-size 70 --device {device}",
        # on CPU against the oracle; on CUDA against the prefill ranks' rows at rest (byte for byte)
        "decode_matches": result.matches_oracle,
        "oracle_checked": result.oracle_checked,
        "problems": result.problems[:5],
        "protocol": result.protocol,
        "bytes_sent_equal_at_rest": all(s.bytes_sent == s.bytes_at_rest for s in result.sent),
        "seconds": time.perf_counter() - start,
    }


@refusing
def main(argv: list[str] | None = None) -> int:
    parser = stream_parser(PROG, __doc__.split("\n\n")[0])
    parser.add_argument(
        "--libs",
        action="append",
        default=[],
        metavar="DIR",
        help="a folder of shared libraries to load the ones the wheel misses from (repeatable)",
    )
    parser.add_argument(
        "--no-end-to-end",
        dest="end_to_end",
        action="store_false",
        help="skip the multi-process pd run (default: run it)",
    )
    args = parse_stream_args(parser, argv)
    missing = [d for d in args.libs if not Path(d).is_dir()]
    if missing:
        raise ConfigError(f"--libs {missing[0]!r}: not a folder")
    on_cuda = args.device == "cuda"
    doc: dict[str, Any] = {
        "ok": False,
        "failure": None,
        **run_record("pd_mooncake", argv, args.device),
        "python": platform.python_version(),
        "how_cp_runs": f"rank {args.rank} of C={args.cp_size} alone in one process (LoopbackGroup), the decode in the "
        "same process with its own Mooncake engine"
        + (f"; all-gathers with a modeled wire of {args.wire_gbps:g} GB/s" if args.wire_gbps else ""),
        "timing": ("CUDA events per layer" if on_cuda else "perf_counter (CPU dry run: the numbers mean nothing)")
        + f"; median over the layers after the first of {args.repeats} runs per variant, variants alternating",
        "preset": args.preset,
        "cp_size": args.cp_size,
        "rank": args.rank,
        "n_layers": args.layers,
        "repeats": args.repeats,
        "wire_gbps": args.wire_gbps,
        "mooncake": {},
        "workloads": [],
        "end_to_end": None,
    }
    out = args.out

    def write() -> None:
        out.write_text(json.dumps(doc, indent=1))

    stage = "load"
    try:
        error, loaded = load_mooncake(args.libs)
        doc["mooncake"] = {
            "distribution": mooncake_distribution(),
            "libraries_loaded_from_libs": loaded,
            "import_error": error,
        }
        if error is not None:
            raise RuntimeError(error)
        runs_fit(args)  # after the load: a wheel that does not load is recorded whatever the sizes
        stage = "start engines"
        engines = (MooncakeEngine.start(), MooncakeEngine.start())
        doc["mooncake"]["protocol"] = engines[0].protocol
        variants = list(VARIANTS) if on_cuda else ["plain", "torch", "mooncake_host"]
        for w in args.workloads:
            stage = f"workload {w.name}"
            print(f"{w.name} {w.prefix}+{w.extend}", file=sys.stderr, flush=True)
            doc["workloads"].append(measure(args, w, engines, variants))
            write()
        if args.end_to_end:  # last (the measurement first); its ranks never touch this process's engines
            stage = "end to end"
            print("end to end: pd --transport mooncake", file=sys.stderr, flush=True)
            doc["end_to_end"] = end_to_end(args.device)
        doc["ok"] = True
    except ConfigError:  # a run this machine cannot hold: refused in one line, not recorded as a result
        raise
    except Exception as exc:  # noqa: BLE001 (the failure is the result: recorded, not a crash)
        doc["failure"] = {
            "stage": stage,
            "error": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc().splitlines()[-12:],
        }
        print(f"FAILED at {stage}: {type(exc).__name__}: {exc} (recorded in {out})", file=sys.stderr)
    write()
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
