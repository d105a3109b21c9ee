"""The benchmark and planner scripts refuse bad input as the CLI does: one ``error:`` line, exit 2,
before any work (``reference_impl/tool_args.py``)."""

from __future__ import annotations

import json

import pytest
import torch

from reference_impl.bench import layer, long_context, pd_mooncake, pd_stream, v4
from reference_impl.errors import ConfigError
from reference_impl.planner import designs as planner_designs
from reference_impl.planner import v4 as planner_v4
from reference_impl.planner.v4 import plan_v4
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
        cases += [(m.main, ["--out", f"{tmp}/x.json"], "this benchmark needs a CUDA device")
                  for m in (layer, v4, pd_mooncake, pd_stream)]
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


@pytest.mark.parametrize(("args", "words"), [
    (("deepseek-v3.2", 8, [1024], [0], 48.0), "preset='deepseek-v3.2'"),
    (("tiny-v4", True, [1024], [0], 48.0), "cp_size=True"),
    (("tiny-v4", 8, [], [0], 48.0), "contexts=[]"),
    (("tiny-v4", 8, [1024], [-1], 48.0), "levels=[-1]"),
    (("tiny-v4", 8, [1024], [0], float("nan")), "kv_budget_gib=nan"),
])
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
