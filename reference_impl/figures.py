"""Figures that carry what they draw: the numbers a plot or a diagram shows, stored in the file itself.

A committed SVG or PNG goes stale silently when its results change and nobody redraws it. Each
figure of the site is drawn by a function from a plain *data* object (a JSON-able dict: the values
and labels it draws, nothing else), and :func:`save` writes that object into the file's metadata
(``dc:description`` in an SVG, a ``Description`` text chunk in a PNG). :func:`embedded` reads it
back, so a test can compute the data again from the current inputs and compare: equal data is the
same drawing, and no image is compared pixel by pixel (the bytes differ between matplotlib versions).
"""

from __future__ import annotations

import json
import re
import struct
import zlib
from pathlib import Path
from typing import Any

PREFIX = "figure data: "


def encode(data: dict[str, Any]) -> str:
    # Floats rounded to what a figure can show, so a recomputation on another machine compares equal.
    return PREFIX + json.dumps(_rounded(data), sort_keys=True, separators=(",", ":"))


def same_up_to_rounding(a: Any, b: Any, rel: float = 1e-9) -> bool:
    """Whether two JSON-like values are equal, floats within ``rel`` of each other: a results file
    recomputed on another machine (another Python's float summation, another libm) compares equal."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_up_to_rounding(a[k], b[k], rel) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_up_to_rounding(x, y, rel) for x, y in zip(a, b))
    if isinstance(a, float) or isinstance(b, float):
        if (
            isinstance(a, bool)
            or isinstance(b, bool)
            or not isinstance(a, (int, float))
            or not isinstance(b, (int, float))
        ):
            return False
        return a == b or abs(a - b) <= rel * max(abs(a), abs(b))
    return a == b


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return float(f"{value:.6g}")
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_rounded(v) for v in value]
    return value


def save(fig: Any, path: Path, data: dict[str, Any], **kwargs: Any) -> None:
    """``fig.savefig(path)`` with ``data`` in the metadata, no date, fixed SVG ids."""
    import matplotlib

    matplotlib.rcParams["svg.hashsalt"] = "dsa-cp"
    metadata = {"Description": encode(data)}
    metadata["Date" if path.suffix == ".svg" else "Software"] = None
    fig.savefig(path, metadata=metadata, **kwargs)


def embedded(path: Path) -> dict[str, Any] | None:
    """The data a figure file carries, None when it carries none."""
    raw = path.read_bytes()
    if path.suffix == ".svg":
        m = re.search(rb"<dc:description>(.*?)</dc:description>", raw, re.S)
        text = m and m.group(1).decode().replace("&quot;", '"').replace("&lt;", "<").replace("&gt;", ">").replace(
            "&amp;", "&"
        )
    else:
        text = _png_text(raw).get("Description")
    if not text or not text.startswith(PREFIX):
        return None
    return json.loads(text[len(PREFIX) :])


def expected(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` as :func:`embedded` returns it after a round trip through a file."""
    return json.loads(encode(data)[len(PREFIX) :])


def _png_text(raw: bytes) -> dict[str, str]:
    chunks, pos = {}, 8
    while pos < len(raw):
        length, kind = struct.unpack(">I4s", raw[pos : pos + 8])
        body = raw[pos + 8 : pos + 8 + length]
        if kind == b"tEXt":
            key, _, value = body.partition(b"\0")
            chunks[key.decode("latin-1")] = value.decode("latin-1")
        elif kind == b"zTXt":
            key, _, rest = body.partition(b"\0")
            chunks[key.decode("latin-1")] = zlib.decompress(rest[1:]).decode("latin-1")
        elif kind == b"iTXt":
            key, _, rest = body.partition(b"\0")
            flag, _method = rest[0], rest[1]
            _lang, _, rest = rest[2:].partition(b"\0")
            _tkey, _, text = rest.partition(b"\0")
            chunks[key.decode("latin-1")] = (zlib.decompress(text) if flag else text).decode("utf-8")
        pos += 12 + length
    return chunks
