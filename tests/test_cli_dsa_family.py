"""The DSA-family knobs on the command line: the MLA cache scale format, the IndexShare pattern and
CPU-sized real presets; one name each across config field, flag and ``DSACP_*`` variable."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from reference_impl.cli import main
from reference_impl.config import knob_names

KNOBS = ("mla_scale_fmt", "index_topk_pattern", "cpu_widths")

BAD_INPUT = [
    (["run", "--mla-scale-fmt", "e8m0"], {}, "--mla-scale-fmt: unknown MLA scale format 'e8m0': use ue8m0, fp32"),
    (["run"], {"DSACP_MLA_SCALE_FMT": ""}, "DSACP_MLA_SCALE_FMT: unknown MLA scale format '': use ue8m0, fp32"),
    (
        ["run"],
        {"DSACP_MLA_SCALE_FMT": "UE8M0"},
        "DSACP_MLA_SCALE_FMT: unknown MLA scale format 'UE8M0': use ue8m0, fp32",
    ),
    (["run", "--index-topk-pattern", "SF"], {}, "layer 0 is shared"),
    (["run", "--n-layers", "3", "--index-topk-pattern", "FS"], {}, "has 2 letters for 3 layers"),
    (["run"], {"DSACP_INDEX_TOPK_PATTERN": "FQ"}, "found 'Q'"),
    (["run"], {"DSACP_CPU_WIDTHS": "maybe"}, "DSACP_CPU_WIDTHS='maybe'"),
    (["plan", "--preset", "glm-5", "--index-topk-pattern", "FS"], {}, "2 letters for 78 layers"),
    (["pd", "--n-layers", "2", "--index-topk-pattern", "FS", "--transfer", "pages"], {}, "IndexShare"),
]


@pytest.mark.parametrize(("argv", "env", "words"), BAD_INPUT, ids=[" ".join(a) + str(e) for a, e, _ in BAD_INPUT])
def test_bad_values_are_one_line_exit_2(capsys, monkeypatch, argv: list[str], env: dict[str, str], words: str) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and words in err and err.count("\n") == 1, err


def test_glm52_runs_from_the_command_line_with_the_scale_format_from_the_environment(capsys, monkeypatch) -> None:
    monkeypatch.setenv("DSACP_MLA_SCALE_FMT", "fp32")
    argv = [
        "run",
        "--preset",
        "glm-5.2",
        "--n-layers",
        "4",
        "--cpu-widths",
        "--phases",
        "8",
        "--requests",
        "0+40,8+24",
        "--page-size",
        "16",
        "--json",
    ]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["matches_oracle"] is True and report["cache_equal"] is True
    config = report["config"]
    assert (config["preset"], config["mla_scale_fmt"], config["index_topk_pattern"], config["cpu_widths"]) == (
        "glm-5.2",
        "fp32",
        "FFFS",
        True,
    )


def test_every_new_knob_is_on_the_knobs_page() -> None:
    page = (Path(__file__).resolve().parent.parent / "docs" / "knobs.md").read_text()
    for field in KNOBS:
        for spelling in knob_names(field):
            assert f"`{spelling}`" in page, spelling
    assert "`glm-5.2`" in page


def test_setup_installs_the_pinned_transformers_and_keeps_an_installed_5x(monkeypatch) -> None:
    """A fresh machine (CI) gets requirements-dev.txt's pin; an offline GPU box keeps its own 5.x."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from packaging.requirements import Requirement
    from packaging.version import Version

    import ensure_deps

    pin = next(
        line
        for line in (ensure_deps.ROOT / "requirements-dev.txt").read_text().splitlines()
        if line.startswith("transformers")
    )
    assert pin == "transformers==5.25.0"
    for installed, kept in (("5.17.0", True), ("5.25.0", True), ("4.57.1", False), (None, False)):
        monkeypatch.setattr(
            ensure_deps, "installed_version", lambda name, v=installed: None if v is None else Version(v)
        )
        assert ensure_deps.satisfied(Requirement(pin)) is kept, installed


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"mla_scale_fmt": "fp32"}, "mla_scale_fmt=fp32: tiny-v4's FP8 entries keep power-of-two scales"),
        ({"index_topk_pattern": "FS"}, "index_topk_pattern: tiny-v4 has no IndexShare"),
        ({"cpu_widths": True}, "cpu_widths: tiny-v4 has no CPU-width variant"),
    ],
)
def test_deepseek_v4_refuses_the_dsa_cache_knobs_by_name(change: dict, words: str) -> None:
    from reference_impl.config import ConfigError, Request, RunConfig

    with pytest.raises(ConfigError, match=re.escape(words)):
        RunConfig(requests=(Request(0, 40),), cp_size=2, preset="tiny-v4", **change)
