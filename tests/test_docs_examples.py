"""The code blocks of docs/baseline.md run, in order, in one namespace (the page's promise)."""

from __future__ import annotations

import re
from pathlib import Path

PAGE = Path(__file__).resolve().parent.parent / "docs" / "baseline.md"


def test_the_baseline_page_examples_run(monkeypatch, tmp_path) -> None:
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)
    assert len(blocks) >= 6
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "baseline_examples"}
    for i, block in enumerate(blocks):
        exec(compile(block, f"{PAGE.name} block {i + 1}", "exec"), namespace)  # noqa: S102
    assert namespace["report"]["matches_oracle"] is True
