"""Argument checks shared by the benchmark and planner scripts (``python -m reference_impl.bench.*``,
``python -m reference_impl.planner.*``), so that they refuse bad input as the ``dsa-cp`` command does:
one ``error: ...`` line naming the flag, exit 2, before any work starts.

Contract: each check raises :class:`~reference_impl.errors.ConfigError` naming the flag; a script's
``main`` runs under :func:`refusing`, which turns that error into the line and the exit code.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from reference_impl.errors import ConfigError


def refusing(main: Callable[[list[str] | None], int]) -> Callable[[list[str] | None], int]:
    """``main(argv) -> exit code``, with a :class:`ConfigError` printed as one line and exit 2."""

    @functools.wraps(main)
    def wrapped(argv: list[str] | None = None) -> int:
        try:
            return main(argv)
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2

    return wrapped


def require_cuda(device: str) -> None:
    """Refuse ``--device cuda`` on a machine without a visible CUDA device."""
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("this benchmark needs a CUDA device (--device cpu: a dry run)")


def output_file(path: str | None, flag: str = "--out") -> Path:
    """``path`` as a file this user can write (its folder exists; it is not a folder itself)."""
    if path is None or not str(path).strip():
        raise ConfigError(f"{flag}: need a file path")
    out = Path(path)
    folder = out.parent if str(out.parent) else Path(".")
    if out.is_dir():
        raise ConfigError(f"{flag} {str(path)!r}: is a folder; give a file path")
    if not folder.is_dir():
        raise ConfigError(f"{flag} {str(path)!r}: the folder {str(folder)!r} does not exist")
    existed = out.exists()
    try:  # the one sure test: open it for writing (appending: a stored file keeps its bytes until written)
        with open(out, "a"):
            pass
    except OSError as exc:
        raise ConfigError(f"{flag} {str(path)!r}: cannot write there ({exc.strerror or exc})") from None
    if not existed:
        out.unlink(missing_ok=True)
    return out


def input_json(path: str, flag: str) -> dict[str, Any]:
    """The JSON object stored at ``path``, or an error naming ``flag`` (missing, unreadable, not a JSON object)."""
    source = Path(path)
    try:
        doc = json.loads(source.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{flag} {path!r}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{flag} {path!r}: cannot read it ({getattr(exc, 'strerror', None) or exc})") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{flag} {path!r}: not JSON ({exc.msg}, line {exc.lineno})") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{flag} {path!r}: holds a JSON {type(doc).__name__}, not a results object")
    return doc


def int_list(text: str, flag: str, minimum: int, maximum: int | None = None) -> list[int]:
    """A comma-separated list of integers within ``[minimum, maximum]`` (``"131072,1048576"``)."""
    values: list[int] = []
    for part in text.split(","):
        try:
            value = int(part.strip())
        except ValueError:
            raise ConfigError(f"{flag} {text!r}: {part.strip()!r} is not an integer") from None
        if value < minimum or (maximum is not None and value > maximum):
            wanted = f"within {minimum}..{maximum}" if maximum is not None else f"at least {minimum}"
            raise ConfigError(f"{flag} {text!r}: {value} is not {wanted}")
        values.append(value)
    return values


def positive(value: float, flag: str) -> float:
    """``value`` when it is a finite number above zero."""
    if not (value > 0 and value != float("inf")):
        raise ConfigError(f"{flag} {value!r}: need a finite number above 0")
    return value


def one_of(value: str, choices: Sequence[str], flag: str) -> str:
    if value not in choices:
        raise ConfigError(f"{flag} {value!r}: use one of {', '.join(choices)}")
    return value
