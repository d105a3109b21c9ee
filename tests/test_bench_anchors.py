"""``bench.anchors`` run dry on a CPU: the anchors absent (each case records why), present (stand-ins
with the production signatures, computed by the torch references: the check, the interleaved timing
and the paired comparison), wrong (the check fails), broken (the import error is recorded)."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from reference_impl.bench import anchors


def _run(tmp_path: Path, *extra: str) -> dict[str, Any]:
    out = tmp_path / "anchors.json"
    assert anchors.main(["--dry-run", "--repeats", "2", "--check-rows", "12", "--out", str(out), *extra]) == 0
    return json.loads(out.read_text())


def _fake_flash_mla(scale_out: float = 1.0) -> types.ModuleType:
    from reference_impl.families.deepseek_v4.model.sparse import sparse_attention_sinks
    from reference_impl.model import sparse_attention as ref

    def flash_mla_sparse_fwd(
        q: torch.Tensor,
        kv: torch.Tensor,
        indices: torch.Tensor,
        sm_scale: float,
        d_v: int = 512,
        attn_sink: torch.Tensor | None = None,
        topk_length: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        assert kv.dim() == 3 and kv.shape[1] == 1 and indices.dim() == 3 and indices.dtype == torch.int32
        if attn_sink is not None:
            out = sparse_attention_sinks(q, kv[:, 0], indices[:, 0], attn_sink, sm_scale)
            lse = torch.zeros(q.shape[:2])
        else:
            out, lse = ref.sparse_mla_attention(q, kv[:, 0], indices[:, 0], sm_scale, d_v)
            lse = torch.where(torch.isneginf(lse), torch.inf, lse)  # FlashMLA's empty row
        return (out * scale_out).to(torch.bfloat16), lse, lse

    mod = types.ModuleType("flash_mla")
    mod.flash_mla_sparse_fwd = flash_mla_sparse_fwd  # type: ignore[attr-defined]
    mod.__version__ = "stand-in"  # type: ignore[attr-defined]
    return mod


def _fake_deep_gemm() -> types.ModuleType:
    from reference_impl.model import sparse_attention as ref

    def fp8_mqa_logits(
        q: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        weights: torch.Tensor,
        cu_seq_len_k_start: torch.Tensor,
        cu_seq_len_k_end: torch.Tensor,
        clean_logits: bool = True,
        max_seqlen_k: int = 0,
    ) -> torch.Tensor:
        assert cu_seq_len_k_start.dtype == torch.int32 and clean_logits and max_seqlen_k == 0
        k, sf = kv
        scores = ref.indexer_scores(q, weights, k, sf)
        cols = torch.arange(k.shape[0])
        seen = (cols >= cu_seq_len_k_start[:, None]) & (cols < cu_seq_len_k_end[:, None])
        return scores.masked_fill(~seen, float("-inf"))

    mod = types.ModuleType("deep_gemm")
    mod.fp8_mqa_logits = fp8_mqa_logits  # type: ignore[attr-defined]
    return mod


def test_absent_anchors_are_recorded_with_the_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "flash_mla", None)  # find_spec -> None: not installed
    monkeypatch.setitem(sys.modules, "deep_gemm", None)
    doc = _run(tmp_path)
    assert doc["kind"] == "dry-run" and [c["case"] for c in doc["cases"]] == list(anchors.CASE_NAMES)
    for module in ("flash_mla", "deep_gemm"):
        assert not doc["anchors"][module]["available"] and "not built" in doc["anchors"][module]["why"]
        assert doc["anchors"][module]["pin"]["commit"] == anchors.PINS[module]["commit"]
    for case in doc["cases"]:
        assert case["theirs"]["status"] == "not run" and "not built" in case["theirs"]["why"]
        assert "comparison" not in case and "check" not in case
        assert len(case["ours"]["ms_rounds"]) == 2 and case["ours"]["tflops"] > 0
    v32 = doc["cases"][0]
    assert v32["published"]["published_tflops"] > 0 and "not measured here" in v32["published"]["marked"]
    shape = v32["shape"]  # the independent FLOP count, every slot
    assert v32["flops"] == 2.0 * shape["T"] * shape["topk"] * shape["heads"] * (shape["d_qk"] + shape["d_v"])
    assert v32["flops_valid_slots"] < v32["flops"]


def test_present_anchors_are_checked_timed_and_compared(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "flash_mla", _fake_flash_mla())
    monkeypatch.setitem(sys.modules, "deep_gemm", _fake_deep_gemm())
    monkeypatch.setattr(anchors, "find_spec", lambda name: object())
    doc = _run(tmp_path, "--repeats", "3")
    assert doc["anchors"]["flash_mla"]["available"] and doc["anchors"]["flash_mla"]["version"] == "stand-in"
    for case in doc["cases"]:
        assert case["check"]["ok"], case["check"]
        assert len(case["theirs"]["ms_rounds"]) == 3 and case["theirs"]["tflops"] > 0
        comparison = case["comparison"]
        assert comparison["a"] == "ours" and comparison["b"] == "theirs" and comparison["difference"]["n"] == 3
        assert comparison["verdict"] == "within noise"  # 3 repeats never call a winner
    logits = doc["cases"][2]
    assert logits["check"]["masked_all_neg_inf"] and logits["theirs_rows_per_call"] >= 1


def test_a_wrong_anchor_fails_the_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "flash_mla", _fake_flash_mla(scale_out=1.1))
    monkeypatch.setitem(sys.modules, "deep_gemm", None)
    monkeypatch.setattr(anchors, "find_spec", lambda name: object() if sys.modules.get(name) else None)
    doc = _run(tmp_path, "--cases", "v32-attention")
    check = doc["cases"][0]["check"]
    assert not check["ok"] and check["out_rel_err"] > anchors.TOLERANCES["attention_out_rel_err"]


def test_an_anchor_that_fails_to_import_is_recorded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "site" / "flash_mla"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('cuda.so: undefined symbol: _ZN3c10')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delitem(sys.modules, "flash_mla", raising=False)
    mod, record = anchors.load_anchor("flash_mla")
    assert mod is None and not record["available"]
    assert record["why"].startswith("ImportError: cuda.so: undefined symbol")


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["--cases", "v5-attention"], "--cases"),
        (["--cases", "logits-1m,logits-1m"], "--cases"),
        (["--repeats", "0"], "--repeats"),
        (["--logits-budget-gib", "-1"], "--logits-budget-gib"),
    ],
)
def test_bad_flags_are_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], names: str
) -> None:
    try:
        code = anchors.main(["--dry-run", "--out", str(tmp_path / "x.json"), *argv])
    except SystemExit as exc:  # argparse's own refusals exit
        code = exc.code  # type: ignore[assignment]
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error:") and names in err[0]
    assert not (tmp_path / "x.json").exists()


def test_the_page_table_renders_a_run_or_says_not_measured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    import results_tables

    assert "Not measured on the H200 yet" in results_tables.anchors(None)
    monkeypatch.setitem(sys.modules, "flash_mla", _fake_flash_mla())
    monkeypatch.setitem(sys.modules, "deep_gemm", None)
    monkeypatch.setattr(anchors, "find_spec", lambda name: object() if sys.modules.get(name) else None)
    doc = _run(tmp_path, "--cases", "v32-attention,logits-128k")
    assert "numbers mean nothing" in results_tables.anchors(doc)
    text = results_tables.anchors({**doc, "kind": "measured"})
    v32, logits = (line for line in text.splitlines() if line.startswith("| v32") or line.startswith("| logits"))
    ratio = doc["cases"][0]["comparison"]["ratio"]
    assert f"{ratio['median']:.2f} ({ratio['min']:.2f}-{ratio['max']:.2f})" in v32 and "within noise" in v32
    assert "`flash_mla_sparse_fwd`" in v32 and "| yes |" in v32
    assert "not run: not built" in logits and "**published**" not in logits  # no published figure for DeepGEMM
