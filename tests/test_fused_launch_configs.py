"""Launch configs of the phase-7 fused kernels: every config and code path gives torch's bytes.

The kernels run under the CPU interpreter. ``one_pass`` (all loads before the first store) and the
rerange's head + tail split are ordinary Triton code there. ``fast_div`` (division by reciprocal and
one FMA correction) is GPU-only, because the interpreter's ``fma`` rounds twice: its formula is
checked exhaustively in exact arithmetic, and its kernel code runs here with an exactly rounded
``fma`` patched into the interpreter. The launch-config sweep of the benchmark is in
``tests/test_kernels_fused.py`` (dry run).
"""

from __future__ import annotations

import struct
from fractions import Fraction

import numpy as np
import pytest
import torch
from conftest import as_bytes

triton = pytest.importorskip("triton")

from reference_impl.config import ConfigError  # noqa: E402 (after the importorskip)
from reference_impl.cp.split import build_split  # noqa: E402 (after the importorskip)
from reference_impl.cp.split_index import rerange_tensor  # noqa: E402 (after the importorskip)
from reference_impl.kernels import fused_configs, fused_torch  # noqa: E402 (after the importorskip)
from reference_impl.kvcache.layout import KVLayout  # noqa: E402 (after the importorskip)


def _kv(n: int, width: int, seed: int) -> torch.Tensor:
    """bf16 rows over many magnitudes, with the edge cases of the quantizer: an all-zero row (amax
    floor), -0.0 values, values so small that they quantize to +-0, huge values. (No bf16
    subnormals: the interpreter converts them to float32 wrongly; the GPU's conversion is exact.)"""
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(n, width, generator=gen) * torch.exp2(torch.randint(-30, 30, (n, 1), generator=gen).float())
    kv[0] = 0.0
    kv[1] = -0.0
    kv[2, ::3] = -0.0
    kv[3] = torch.randn(width, generator=gen).clamp(-4, 4) * 2.0**-118  # smallest normals: +-0 codes
    kv[4] = torch.randn(width, generator=gen) * 2.0**120
    return kv.to(torch.bfloat16)


# ---- configs ------------------------------------------------------------------------------------


def test_launch_config_defaults_overrides_and_rerange_width_classes() -> None:
    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    assert set(fused_configs.GPU_CONFIGS) == set(fused_configs.CPU_CONFIGS)
    for kernel in fused_configs.KERNELS:  # same keys on both kinds: one override works on both
        assert fused_configs.GPU_CONFIGS[kernel].keys() == fused_configs.CPU_CONFIGS[kernel].keys()
    config = fused_configs.launch_config("store_index", gpu, {"block_m": 64, "num_warps": None})
    assert config == {**fused_configs.GPU_CONFIGS["store_index"], "block_m": 64}
    assert fused_configs.default_config("store_index", cpu) == fused_configs.CPU_CONFIGS["store_index"]
    with pytest.raises(ConfigError, match="one_pass"):
        fused_configs.launch_config("store_mla_bf16", gpu, {"one_pass": True})
    with pytest.raises(ConfigError, match="store_nothing"):
        fused_configs.default_config("store_nothing", gpu)
    assert fused_configs.rerange_kernel_name(256) == "rerange_index"  # indexer K, bf16
    assert fused_configs.rerange_kernel_name(1152) == "rerange_kv"  # MLA latent, bf16


# ---- every config and code path: torch's bytes --------------------------------------------------

STORE_CONFIGS = [
    {"block_m": 16, "num_warps": 1, "one_pass": False},
    {"block_m": 4, "num_warps": 2, "one_pass": True},
    {"block_m": 8, "num_warps": 1, "one_pass": True},
]


@pytest.mark.parametrize("dims", [(512, 64), (384, 64), (128, 0)])  # 384: 3 blocks, a masked 4th lane
def test_store_mla_fp8_configs_give_torch_bytes(fs: object, dims: tuple[int, int]) -> None:
    kv_lora, rope = dims
    layout = KVLayout(kv_lora, rope, "fp8", 4)
    kv = _kv(21, kv_lora + rope, seed=kv_lora)
    dst = torch.randperm(24, generator=torch.Generator().manual_seed(1))[:21]
    want = torch.randint(0, 256, (24, layout.mla_bytes), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    start = want.clone()
    fused_torch.store_mla_torch(kv, None, dst, want, layout)
    for config in STORE_CONFIGS:
        pool = start.clone()  # untouched slots keep their bytes
        fs.store_mla_triton(kv, None, dst, pool, layout, **config)  # type: ignore[attr-defined]
        assert torch.equal(pool, want), config


def test_store_bf16_and_index_configs_give_torch_bytes(fs: object) -> None:
    layout = KVLayout(512, 64, "bf16", 8, index_scale_fmt="fp32")
    kv, k = _kv(19, 576, seed=3), _kv(19, 128, seed=4)
    dst = torch.randperm(24, generator=torch.Generator().manual_seed(5))[:19]
    want_mla = torch.zeros(24, layout.mla_bytes, dtype=torch.uint8)
    want_index = torch.zeros(3, layout.index_page_bytes, dtype=torch.uint8)
    fused_torch.store_mla_torch(kv, None, dst, want_mla, layout)
    fused_torch.store_index_torch(k, None, dst, want_index, layout)
    for block_m, num_warps in ((16, 1), (4, 2), (32, 4)):
        mla, index = torch.zeros_like(want_mla), torch.zeros_like(want_index)
        fs.store_mla_triton(kv, None, dst, mla, layout, block_m=block_m, num_warps=num_warps)  # type: ignore[attr-defined]
        fs.store_index_triton(k, None, dst, index, layout, block_m=block_m, num_warps=num_warps)  # type: ignore[attr-defined]
        assert torch.equal(mla, want_mla) and torch.equal(index, want_index), (block_m, num_warps)


@pytest.mark.parametrize(
    "row",
    [
        (torch.bfloat16, (576,)),
        (torch.bfloat16, (128,)),
        (torch.uint8, (7,)),
        (torch.float32, (3,)),
        (torch.uint8, (1,)),
    ],
)
def test_rerange_configs_give_torch_bytes(fr: object, row: tuple[torch.dtype, tuple[int, ...]]) -> None:
    """Column steps and the one-pass head + tail split (576 bf16 = 256 + 32 words; 7 bytes = 4 + 3)."""
    dtype, shape = row
    meta = build_split("in-seq", 3, [40, 17], [0, 0], page_size=4)
    raw = torch.randint(0, 256, (3, meta.max_rank_len, *shape), dtype=torch.uint8)
    raw = raw if dtype == torch.uint8 else torch.randn(raw.shape).to(dtype)
    want = as_bytes(fused_torch.rerange_padded_torch(raw, meta.rank_lengths, rerange_tensor(meta)))
    index = rerange_tensor(meta, padded=True)
    for config in (
        {"block_t": 16, "block_c": 64, "one_pass": False},
        {"block_t": 8, "block_c": 32, "one_pass": False},
        {"block_t": 16, "one_pass": True},
        {"block_t": 4, "num_warps": 2, "one_pass": True},
    ):
        got = fr.rerange_padded_triton(raw, index, **config)  # type: ignore[attr-defined]
        assert torch.equal(as_bytes(got), want), config
    with pytest.raises(ConfigError, match="block_c"):
        fr.rerange_padded_triton(raw, index, block_c=0)  # type: ignore[attr-defined]


@pytest.mark.parametrize("kv_lora", [512, 384])
def test_materialize_configs_give_torch_bytes(fm: object, kv_lora: int) -> None:
    layout = KVLayout(kv_lora, 64, "fp8", 4)
    n_pages, slots = 5, 20
    mla = torch.zeros(slots, layout.mla_bytes, dtype=torch.uint8)
    index = torch.zeros(n_pages, layout.index_page_bytes, dtype=torch.uint8)
    fused_torch.store_mla_torch(_kv(slots, layout.kv_width, seed=6), None, torch.arange(slots), mla, layout)
    fused_torch.store_index_torch(_kv(slots, 128, seed=7), None, torch.arange(slots), index, layout)
    gen = torch.Generator().manual_seed(8)
    row_source, view_rows = torch.randint(0, slots, (17,), generator=gen), torch.randperm(23, generator=gen)[:17]

    def run(config: dict[str, int | bool] | None) -> list[torch.Tensor]:
        kv = torch.full((23, layout.kv_width), 3.0, dtype=torch.bfloat16)
        i8, sc = torch.full((23, 128), 1.0).to(torch.float8_e4m3fn), torch.full((23,), -1.0)
        args = (mla.view(n_pages, -1), index, row_source, view_rows, kv, i8, sc, layout)
        if config is None:
            fused_torch.materialize_rows_torch(*args)
        else:
            fm.materialize_rows_triton(*args, **config)  # type: ignore[attr-defined]
        return [as_bytes(kv), as_bytes(i8), as_bytes(sc)]

    want = run(None)
    for config in STORE_CONFIGS:
        assert all(torch.equal(a, b) for a, b in zip(run(config), want)), config


# ---- fast division ------------------------------------------------------------------------------


def _rn32(x: Fraction) -> Fraction:
    """Round to the nearest float32, ties to even (normal range)."""
    if x == 0:
        return Fraction(0)
    sign, x = (-1 if x < 0 else 1), abs(x)
    e = x.numerator.bit_length() - x.denominator.bit_length()
    if Fraction(2) ** e > x:
        e -= 1
    assert -126 <= e <= 127
    ulp = Fraction(2) ** (e - 23)
    whole, rest = divmod(x / ulp, 1)
    if rest > Fraction(1, 2) or (rest == Fraction(1, 2) and whole % 2):
        whole += 1
    return sign * whole * ulp


def test_fast_division_equals_correctly_rounded_division() -> None:
    """The kernels' ``_negated_quotient`` in exact arithmetic, for every bf16 significand ``a`` and
    every scale ``b = RN(max(amax, 1e-4) / 448)`` a bf16 block can have (129 significands):
    ``-fma(fma(n, b, a), -y, n)`` with ``y = RN(1 / b)``, ``n = RN(a * -y)`` equals ``RN(a / b)``.

    Significands suffice: with no underflow (every quotient that can round to a nonzero e4m3 value,
    ``|a / b| > 2**-11``, keeps every intermediate normal) scaling ``a`` or ``b`` by a power of two
    scales every step exactly; two binades of ``a`` show it. Smaller quotients become +-0 on both paths.
    """
    floor = Fraction(struct.unpack("<f", struct.pack("<f", 1e-4))[0])
    amaxes = [Fraction(128 + m, 128) for m in range(128)] + [floor]
    scales = sorted({_rn32(amax / 448) for amax in amaxes})
    assert len(scales) == 129
    checked = 0
    for b in scales:
        neg_y = -_rn32(1 / b)
        for binade in (Fraction(1), Fraction(1, 2**7)):
            for m in range(128):
                a = Fraction(128 + m, 128) * binade
                neg_q0 = _rn32(a * neg_y)
                residual = _rn32(neg_q0 * b + a)
                assert -_rn32(residual * neg_y + neg_q0) == _rn32(a / b), (a, b)
                checked += 1
    assert checked == 129 * 2 * 128


def _exact_fma32(x: np.ndarray, y: np.ndarray, z: np.ndarray) -> np.ndarray:
    """float32 ``x * y + z`` rounded once: the product is exact in float64, the float64 sum is made
    round-to-odd (TwoSum error), and rounding that to float32 is then correct (53 >= 24 + 2 bits)."""
    p = x.astype(np.float64) * y.astype(np.float64)
    z64 = z.astype(np.float64)
    s = p + z64
    bb = s - p
    err = (p - (s - bb)) + (z64 - bb)
    even = (np.asarray(s).view(np.int64) & 1) == 0
    fix = (err != 0) & even & np.isfinite(s)
    s = np.where(fix, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
    return s.astype(np.float32)


@pytest.fixture()
def exact_fma(monkeypatch: pytest.MonkeyPatch, fs: object) -> None:
    """The interpreter with a correctly rounded float32 ``fma``, and ``fast_div`` allowed on CPU."""
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_fma

    def create_fma(self: object, x: object, y: object, z: object) -> object:
        if x.data.dtype != np.float32:  # type: ignore[attr-defined]
            return original(self, x, y, z)
        return interpreter.TensorHandle(_exact_fma32(x.data, y.data, z.data), z.dtype.scalar)  # type: ignore[attr-defined]

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_fma", create_fma)
    monkeypatch.setattr(fs, "_fast_div", lambda config, values: bool(config.get("fast_div")))


def test_exact_fma_rounds_once() -> None:
    """A case the interpreter's fma gets wrong: (1 + 2**-12)**2 - 1 needs the product's low bits."""
    x = np.array([1 + 2.0**-12], dtype=np.float32)
    fused = _exact_fma32(x, x, np.array([-1.0], dtype=np.float32))
    assert fused[0] == np.float32(2.0**-11 + 2.0**-24)
    assert (x * x + np.float32(-1.0))[0] != fused[0]  # two roundings lose 2**-24


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf * 0, on purpose
@pytest.mark.parametrize("mla_scale_fmt", ["fp32", "ue8m0"])
@pytest.mark.parametrize("one_pass", [False, True])
def test_fast_division_kernels_give_torch_bytes(
    fs: object, exact_fma: None, one_pass: bool, mla_scale_fmt: str
) -> None:
    """The fast-division code path of the FP8 MLA store and the index store (fp32 scales), with the
    edge rows of ``_kv`` and an inf in one block (its other values become +-0 like torch's
    ``x / inf``; the inf itself a NaN, whose bit pattern may differ). ``ue8m0`` MLA scales take the
    power-of-two path instead (an inf scale's reciprocal is 0 there too)."""
    layout = KVLayout(512, 64, "fp8", 4, index_scale_fmt="fp32", mla_scale_fmt=mla_scale_fmt)
    kv, k = _kv(23, 576, seed=10), _kv(23, 128, seed=11)
    kv[5, 130] = float("inf")
    dst = torch.randperm(24, generator=torch.Generator().manual_seed(12))[:23]
    want_mla = torch.zeros(24, layout.mla_bytes, dtype=torch.uint8)
    want_index = torch.zeros(6, layout.index_page_bytes, dtype=torch.uint8)
    fused_torch.store_mla_torch(kv, None, dst, want_mla, layout)
    fused_torch.store_index_torch(k, None, dst, want_index, layout)
    mla, index = torch.zeros_like(want_mla), torch.zeros_like(want_index)
    fs.store_mla_triton(kv, None, dst, mla, layout, block_m=8, one_pass=one_pass, fast_div=True)  # type: ignore[attr-defined]
    fs.store_index_triton(k, None, dst, index, layout, block_m=8, fast_div=True)  # type: ignore[attr-defined]
    nan_byte = mla[dst[5], 130].clone()
    assert int(nan_byte) & 0x7F == 0x7F  # the inf / inf position: a NaN code
    mla[dst[5], 130] = want_mla[dst[5], 130]
    assert torch.equal(mla, want_mla) and torch.equal(index, want_index)
    assert ((want_mla[dst[5], 128:256] & 0x7F) != 0).sum() == 1  # the block's finite values: +-0


def test_apply_sweep_writes_each_best_config_into_the_gpu_table(tmp_path, monkeypatch) -> None:
    """scripts/apply_sweep.py: swept kernels take their best config, the others keep theirs, and the
    rewritten module still imports with that table."""
    import importlib.util
    import json
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "scripts" / "apply_sweep.py"
    spec = importlib.util.spec_from_file_location("apply_sweep", script)
    apply_sweep = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(apply_sweep)  # type: ignore[union-attr]
    target = tmp_path / "fused_configs.py"
    target.write_text(Path(fused_configs.__file__).read_text())
    monkeypatch.setattr(apply_sweep, "TARGET", target)
    best = {"block_m": 16, "num_warps": 8}
    sweep = {"sweep": {"store_mla_bf16": {"best": best, "default_fraction_of_copy": 0.5, "fraction_of_copy": 0.7}}}
    (tmp_path / "sweep.json").write_text(json.dumps(sweep))
    apply_sweep.main(str(tmp_path / "sweep.json"))
    namespace: dict[str, object] = {}
    exec(compile(target.read_text(), str(target), "exec"), namespace)
    table = namespace["GPU_CONFIGS"]
    assert table["store_mla_bf16"] == best  # type: ignore[index]
    others = {k: v for k, v in fused_configs.GPU_CONFIGS.items() if k != "store_mla_bf16"}
    assert all(table[k] == v for k, v in others.items())  # type: ignore[index]


def test_apply_sweep_writes_the_compute_winners_into_the_kernel_defaults(tmp_path) -> None:
    """A compute sweep: the fastest attention config that passed its check (not a faster failing
    one), the fastest indexer config and the fastest passing Gluon config become the modules'
    ``GPU_DEFAULT_CONFIG`` lines."""
    import importlib.util
    from pathlib import Path
    from types import SimpleNamespace

    from reference_impl.bench import compute_sweep
    from reference_impl.kernels import indexer_triton, sparse_mla_gluon, sparse_mla_triton

    script = Path(__file__).resolve().parent.parent / "scripts" / "apply_sweep.py"
    spec = importlib.util.spec_from_file_location("apply_sweep", script)
    apply_sweep = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(apply_sweep)  # type: ignore[union-attr]
    stand_ins = []
    for module in (sparse_mla_triton, indexer_triton, sparse_mla_gluon):
        copy = tmp_path / Path(module.__file__).name
        copy.write_text(Path(module.__file__).read_text())
        stand_ins.append(SimpleNamespace(__file__=str(copy), GPU_DEFAULT_CONFIG=module.GPU_DEFAULT_CONFIG))
    attn = lambda bk, tf, ok: {  # noqa: E731
        "config": dict(zip(compute_sweep.ATTENTION_KEYS, (64, bk, 8, 2, False, True, False, False))),
        "triton_tflops": tf,
        "check": {"ok": ok},
    }
    idx = lambda bs, ms: {  # noqa: E731
        "config": dict(zip(compute_sweep.INDEXER_KEYS, (64, bs, 4, 3, "fp8"))),
        "triton_logits_ms": ms,
        "check": {"ok": True},
    }
    gluon = lambda overlap, tf, ok: {  # noqa: E731  (a Gluon sweep row: no Triton timing)
        "engine_kernel": "gluon",
        "gluon": {"config": dict(zip(compute_sweep.GLUON_KEYS, (overlap, True))), "tflops": tf, "check": {"ok": ok}},
    }
    sweep = {
        "attention": [attn(32, 250.0, True), attn(16, 300.0, False), {"config": {}, "error": "x"}],
        "indexer": [idx(64, 2.0), idx(256, 1.5)],
        "gluon": [gluon(False, 300.0, True), gluon(True, 400.0, False), {"config": {}, "error": "x"}],
    }

    def written(stand_in: SimpleNamespace) -> object:
        source = Path(stand_in.__file__).read_text()
        line = next(ln for ln in source.splitlines() if ln.startswith("GPU_DEFAULT_CONFIG"))
        return eval(line.split("= ", 1)[1])  # the rewritten line's value

    apply_sweep.apply_compute_sweep(sweep, *stand_ins)
    wants = ((64, 32, 8, 2, False, True, False, False), (64, 256, 4, 3, "fp8"), (False, True))
    for stand_in, want in zip(stand_ins, wants, strict=True):
        assert written(stand_in) == want
    # A winner within 1% of the current default's rate (noise) leaves the default alone.
    stand_ins[0].GPU_DEFAULT_CONFIG = written(stand_ins[0])
    sweep["attention"] = [attn(32, 250.0, True), attn(64, 252.0, True)]
    apply_sweep.apply_compute_sweep(sweep, *stand_ins)
    assert written(stand_ins[0]) == (64, 32, 8, 2, False, True, False, False)
    sweep["attention"] = [attn(32, 250.0, True), attn(64, 260.0, True)]
    apply_sweep.apply_compute_sweep(sweep, *stand_ins)
    assert written(stand_ins[0]) == (64, 64, 8, 2, False, True, False, False)
