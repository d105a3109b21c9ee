"""The benchmark and planner scripts refuse bad input as the CLI does: one ``error:`` line, exit 2,
before any work (``reference_impl/tool_args.py``)."""

from __future__ import annotations

import json

import pytest
import torch

from reference_impl.bench import layer, long_context, pd_mooncake, pd_stream, v4
from reference_impl.errors import ConfigError
from reference_impl.families.deepseek_v4 import planner as planner_v4
from reference_impl.families.deepseek_v4.planner import plan_v4
from reference_impl.planner import designs as planner_designs
from reference_impl.tool_args import input_json, int_list, output_file

NO_CUDA = not torch.cuda.is_available()


def _cases(tmp: str) -> list[tuple[object, list[str], str]]:
    cases: list[tuple[object, list[str], str]] = [
        (planner_v4.main, ["--preset", "deepseek-v3.2"], "unknown V4 preset 'deepseek-v3.2': use deepseek-v4-flash"),
        (planner_v4.main, ["--cp-size", "0"], "argument --cp-size: 0 is below 1"),
        (planner_v4.main, ["--kv-budget-gib", "-1"], "argument --kv-budget-gib: -1 is not positive"),
        (planner_v4.main, ["--contexts", "0"], "--contexts '0': 0 is not within 1..134,217,728"),
        (planner_v4.main, ["--levels", "9"], "--levels '9': 9 is not within 0..8"),
        (planner_v4.main, ["--contexts", "12x"], "'12x' is not an integer"),
        (planner_v4.main, ["--out", "/nonexistent-dir/x.json"], "the folder '/nonexistent-dir' does not exist"),
        (planner_v4.main, ["--out", tmp], "is a folder"),
        (planner_designs.main, ["--out", "/nonexistent-dir/x.json"], "does not exist"),
        (long_context.main, ["--replan", "/nonexistent.json"], "--replan '/nonexistent.json': no such file"),
        (long_context.main, ["--replan", "README.md"], "--replan 'README.md': not JSON"),
        (layer.main, ["--replan", "README.md"], "--replan 'README.md': not JSON"),
    ]
    if NO_CUDA:
        cases += [
            (m.main, ["--out", f"{tmp}/x.json"], "this benchmark needs a CUDA device")
            for m in (layer, v4, pd_mooncake, pd_stream)
        ]
    return cases


@pytest.mark.parametrize("case", range(len(_cases("T"))))
def test_a_script_refuses_bad_input_in_one_line(tmp_path, capsys, case: int) -> None:
    main, argv, words = _cases(str(tmp_path))[case]
    try:
        code = main(argv)
    except SystemExit as exc:  # a parse error exits, as argparse's do
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and words in err and err.count("\n") == 1, err
    assert not list(tmp_path.iterdir()), "a refused run wrote nothing"


def test_the_v4_planner_prints_without_out(capsys) -> None:
    assert planner_v4.main(["--contexts", "4096", "--levels", "0,8"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["preset"] == "deepseek-v4-flash" and [p["level"] for p in doc["points"]] == [0, 8]


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("deepseek-v3.2", 8, [1024], [0], 48.0), "preset='deepseek-v3.2'"),
        (("tiny-v4", True, [1024], [0], 48.0), "cp_size=True"),
        (("tiny-v4", 8, [], [0], 48.0), "contexts=[]"),
        (("tiny-v4", 8, [1024], [-1], 48.0), "levels=[-1]"),
        (("tiny-v4", 8, [1024], [0], float("nan")), "kv_budget_gib=nan"),
    ],
)
def test_plan_v4_names_the_bad_argument(args: tuple, words: str) -> None:
    with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("]", r"\]")):
        plan_v4(*args)


def test_the_checks_themselves(tmp_path) -> None:
    stored = tmp_path / "r.json"
    stored.write_text('{"a": 1}')
    assert input_json(str(stored), "--replan") == {"a": 1}
    stored.write_text("[1]")
    with pytest.raises(ConfigError, match="holds a JSON list"):
        input_json(str(stored), "--replan")
    assert output_file(str(tmp_path / "new.json")) == tmp_path / "new.json"
    assert not (tmp_path / "new.json").exists(), "the probe leaves no file behind"
    assert stored.read_text() == "[1]", "an existing file keeps its bytes"
    assert int_list("1, 2,3", "--x", 1, 3) == [1, 2, 3]


def test_the_parser_names_an_unknown_flag_and_keeps_values_that_look_like_flags(capsys) -> None:
    """An unknown flag is named before a missing required one; a negative number or an abbreviation
    of a known flag is not mistaken for one; the error is one line and exit 2."""
    from reference_impl.tool_args import Refused, ToolParser, int_arg

    parser = ToolParser("python -m x")
    parser.add_argument("--out", required=True)
    parser.add_argument("--cp-size", type=int_arg(None, 8), default=8)
    assert parser.parse_args(["--out", "a", "--cp", "-3"]).cp_size == -3
    with pytest.raises(Refused) as exc:
        parser.parse_args(["--nope"])
    assert exc.value.code == 2 and str(exc.value) == "error: python -m x: unrecognized arguments: --nope"
    assert capsys.readouterr().err == "error: python -m x: unrecognized arguments: --nope\n"
    with pytest.raises(SystemExit):
        parser.parse_args(["--out", "a", "--cp-size", "9"])
    assert capsys.readouterr().err == "error: python -m x: argument --cp-size: 9 is above 8\n"


def test_stored_fields_name_the_first_field_that_is_wrong() -> None:
    from reference_impl.tool_args import POSITIVE, int_field, stored_fields

    schema = {"n": int_field(1, 4), "rows": [{"ms": POSITIVE, "peak?": POSITIVE}]}
    stored_fields({"n": 2, "rows": [{"ms": 1.5}, {"ms": 2, "peak": 3}]}, schema, "--in f")
    for doc, words in (
        ({"rows": []}, "--in f: missing field n"),
        ({"n": True, "rows": []}, "--in f: field n holds true; need an integer within 1..4"),
        ({"n": 2, "rows": []}, "--in f: field rows must be a non-empty list"),
        ({"n": 2, "rows": [{"ms": 1}, {"ms": 0}]}, "--in f: field rows[1].ms holds 0; need a finite"),
        ({"n": 2, "rows": [{"ms": 1, "peak": None}]}, "field rows[0].peak holds null"),
    ):
        with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
            stored_fields(doc, schema, "--in f")


def test_rank_fits_refuses_by_the_estimate_on_a_cpu_only(monkeypatch) -> None:
    """The one-rank memory check: the footprint estimate of the rank against the free memory, on a
    CPU (on a GPU the estimate's torch-path term is far above what the kernels hold)."""
    from reference_impl import footprint
    from reference_impl.config import Request, RunConfig
    from reference_impl.tool_args import rank_fits

    big = RunConfig(
        preset="deepseek-v3.2", n_layers=4, cp_size=8, check=False, device="cpu", requests=(Request(0, 131072),)
    )
    small = big.replace(preset="tiny", requests=(Request(0, 256),))
    need = footprint.estimate(big, "cpu", "inline").ranks[3]
    monkeypatch.setattr(footprint, "free_bytes", lambda device_type: need - 1)
    with pytest.raises(ConfigError, match=r"--w: rank 3 of C=8 at 131,072 tokens \(deepseek-v3.2, 4 layers\) needs up"):
        rank_fits([small, big], 3, "cpu", "--w")
    rank_fits([small], 3, "cpu", "--w")
    rank_fits([big], 3, "cuda", "--w")
    monkeypatch.setattr(footprint, "free_bytes", lambda device_type: need)
    rank_fits([small, big], 3, "cpu", "--w")
