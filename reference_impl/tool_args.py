"""Argument checks shared by the benchmark and planner scripts (``python -m reference_impl.bench.*``,
``python -m reference_impl.planner.*``), so that they refuse bad input as the ``dsa-cp`` command does:
one ``error: ...`` line naming the flag, exit 2, before any work starts.

Contract: each check raises :class:`~reference_impl.errors.ConfigError` naming the flag; a script's
``main`` runs under :func:`refusing`, which turns that error into the line and the exit code. Its
parser is a :class:`ToolParser`: usage names the command as it is typed, ``--help`` shows every
flag's default, and argparse's own errors (an unknown flag, a value of the wrong type) are one
line too, then exit 2 (a ``SystemExit``, as argparse's are). Scalar flags are typed with
:func:`int_arg`, :func:`float_arg` and :func:`choice_arg` (refused while parsing, naming the flag);
a stored file's fields are checked with :func:`stored_fields`; a benchmark that runs one rank in
this process checks its memory with :func:`rank_fits` before it starts. The scripts under
``scripts/`` use the same parser and checks.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, NoReturn, Protocol

from reference_impl.errors import ConfigError
from reference_impl.families import family_presets

GIB = 1 << 30
# The DSA presets (DeepSeek-V3.2, GLM and the tiny test model): what the DSA benchmarks and planner model;
# DeepSeek-V4's have their own (python -m reference_impl.bench.v4, python -m reference_impl.planner.v4), and so
# have GLM-5.3's (python -m reference_impl.bench.glm53, python -m reference_impl.planner.glm53).
DSA_PRESETS: tuple[str, ...] = family_presets("dsa")
MAX_LAYERS = 128  # layers a benchmark runs or the planner models: more than any preset has (GLM-5: 78)
MAX_REPEATS = 1000  # timed runs per point: past it a benchmark runs for days, not a measurement anyone waits for


class MainFunction(Protocol):
    """A command's ``main(argv=None) -> exit code`` (``argv`` ``None``: the process's arguments)."""

    def __call__(self, argv: list[str] | None = None) -> int: ...


def refusing(main: Callable[[list[str] | None], int]) -> MainFunction:
    """``main(argv) -> exit code``, with a :class:`ConfigError` printed as one line and exit 2."""

    @functools.wraps(main)
    def wrapped(argv: list[str] | None = None) -> int:
        try:
            return main(argv)
        except ConfigError as exc:
            print(f"error: {(str(exc).splitlines() or [''])[0]}", file=sys.stderr)
            return 2

    return wrapped


class Refused(SystemExit):
    """The exit (code 2) of a script whose ``main`` returns a document, not an exit code, after its
    one error line was printed; its text is that line."""

    def __init__(self, line: str) -> None:
        super().__init__(2)
        self.line = line

    def __str__(self) -> str:
        return self.line


def refusing_exit(main: Callable[..., Any]) -> Callable[..., Any]:
    """:func:`refusing` for a ``main(argv)`` that returns a document: a :class:`ConfigError` is
    printed as one line and ends the process with exit 2 (:class:`Refused`)."""

    @functools.wraps(main)
    def wrapped(argv: list[str] | None = None) -> Any:
        try:
            return main(argv)
        except ConfigError as exc:
            line = f"error: {(str(exc).splitlines() or [''])[0]}"
            print(line, file=sys.stderr)
            raise Refused(line) from None

    return wrapped


def require_cuda(device: str) -> None:
    """Refuse ``--device cuda`` on a machine without a visible CUDA device."""
    import torch  # here, not at the top: the scripts that never touch a device start without it

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


def output_folder(path: str, flag: str = "--out") -> Path:
    """``path`` as a folder to write into, created (with its parents) when missing."""
    if not str(path).strip():
        raise ConfigError(f"{flag}: need a folder path")
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"{flag} {str(path)!r}: exists and is not a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{flag} {str(path)!r}: cannot create it ({exc.strerror or exc})") from None
    return folder


def input_folder(path: str, flag: str) -> Path:
    """``path`` when it is an existing folder."""
    folder = Path(path)
    if not folder.is_dir():
        raise ConfigError(f"{flag} {str(path)!r}: {'not a folder' if folder.exists() else 'no such folder'}")
    return folder


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
            raise ConfigError(f"{flag} {text[:80]!r}: {part.strip()[:40]!r} is not an integer") from None
        if value < minimum or (maximum is not None and value > maximum):
            wanted = f"within {minimum:,}..{maximum:,}" if maximum is not None else f"at least {minimum:,}"
            raise ConfigError(f"{flag} {text[:80]!r}: {value} is not {wanted}")
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


# ---- the parser ----------------------------------------------------------------------------------


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's help ends with its default (``off`` for a switch), unless the help already
    says what the default is; a required flag has none."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            not action.option_strings
            or action.required
            or action.default is argparse.SUPPRESS
            or "default" in text.lower()
        ):
            return text
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            shown = "on" if action.default else "off"
        elif action.default is None or action.default == []:
            shown = "none"
        else:
            shown = "%(default)s"
        return f"{text} (default: {shown})".lstrip()


class ToolParser(argparse.ArgumentParser):
    """argparse for a benchmark or planner script: ``prog`` is the command as typed
    (``python -m reference_impl.bench.layer``), help shows defaults, and a parse error is one line
    ``error: PROG: message`` on stderr, then exit 2 (:class:`Refused`, a ``SystemExit`` as argparse's
    own errors are; the usage block is left out)."""

    def __init__(self, prog: str, description: str | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(prog=prog, description=description, **kwargs)

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        """As argparse's, but an unknown flag is named first (argparse would say a required one is missing)."""
        given = list(sys.argv[1:] if args is None else args)
        flags = [flag for action in self._actions for flag in action.option_strings]
        for arg in given:
            if arg == "--":
                break
            name = arg.split("=", 1)[0]
            if not name.startswith("-") or name == "-" or name.lstrip("-").replace(".", "", 1).isdigit():
                continue  # a value (a negative number included)
            if name not in flags and not (name.startswith("--") and any(f.startswith(name) for f in flags)):
                self.error(f"unrecognized arguments: {arg}")
        return super().parse_args(given, namespace)

    def error(self, message: str) -> NoReturn:
        line = f"error: {self.prog}: {message.splitlines()[0] if message else message}"
        print(line, file=sys.stderr)
        raise Refused(line)


# ---- typed flag values: each refuses what it cannot use; argparse names the flag ---------------------


def int_arg(minimum: int | None = None, maximum: int | None = None, why: str = "") -> Callable[[str], int]:
    """An integer flag within ``[minimum, maximum]`` (``why``: the reason for the maximum)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if minimum is not None and value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is below {minimum}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"{value} is above {maximum:,}{f' ({why})' if why else ''}")
        return value

    return parse


def float_arg(maximum: float | None = None, why: str = "", allow_zero: bool = False) -> Callable[[str], float]:
    """A finite number above zero (``allow_zero``: at least zero), at most ``maximum``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
        if value < 0 or (value == 0 and not allow_zero):
            raise argparse.ArgumentTypeError(f"{value:g} is not {'at least 0' if allow_zero else 'positive'}")
        if maximum is not None and value > maximum:
            most = f"{maximum:,.0f}" if maximum == int(maximum) else f"{maximum:g}"
            raise argparse.ArgumentTypeError(f"{value:g} is above {most}{f' ({why})' if why else ''}")
        return value

    return parse


def choice_arg(choices: Sequence[str], what: str, hint: str = "") -> Callable[[str], str]:
    """One of ``choices`` exactly (the empty string refused with the list, as any other); ``hint``
    follows the list (where the other values are taken)."""

    def parse(text: str) -> str:
        if text not in choices:
            raise argparse.ArgumentTypeError(
                f"unknown {what} {text!r}: use {', '.join(choices)}" + (f" ({hint})" if hint else "")
            )
        return text

    return parse


# --device of a benchmark: cuda, or cpu for a dry run of its logic.
device_arg = choice_arg(("cuda", "cpu"), "device")


def dsa_preset_arg() -> Callable[[str], str]:
    """``--preset``'s type in a DSA benchmark: a V4 or GLM-5.3 preset is refused with the benchmark that runs it."""
    return choice_arg(
        DSA_PRESETS,
        "preset",
        "DeepSeek-V4: python -m reference_impl.bench.v4; GLM-5.3: python -m reference_impl.bench.glm53",
    )


def rank_of(rank: int, cp_size: int, rank_flag: str = "--rank", cp_flag: str = "--cp-size") -> int:
    """``rank`` when it is one of ``cp_size`` ranks (0 .. cp_size - 1)."""
    if not 0 <= rank < cp_size:
        raise ConfigError(f"{rank_flag} {rank}: need a rank within 0..{cp_size - 1} ({cp_flag} {cp_size})")
    return rank


# ---- stored result files -------------------------------------------------------------------------


class Field:
    """What a stored file's field must hold: ``what`` (said when it does not) and the test ``ok``."""

    def __init__(self, what: str, ok: Callable[[Any], bool]) -> None:
        self.what, self.ok = what, ok


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    """A finite JSON number that converts to a float (an integer of 400 digits does not)."""
    if _is_int(value):
        return abs(value) < 1 << 63
    return isinstance(value, float) and math.isfinite(value)


def int_field(minimum: int, maximum: int | None = None) -> Field:
    """An integer within ``[minimum, maximum]``."""
    what = f"an integer within {minimum}..{maximum:,}" if maximum is not None else f"an integer of at least {minimum}"
    return Field(what, lambda v: _is_int(v) and v >= minimum and (maximum is None or v <= maximum))


def choice_field(choices: Sequence[str]) -> Field:
    return Field(f"one of {', '.join(choices)}", lambda v: isinstance(v, str) and v in choices)


POSITIVE = Field("a finite number above 0", lambda v: _is_number(v) and v > 0)
NUMBER = Field("a finite number", _is_number)
OPTIONAL_POSITIVE = Field("null or a finite number above 0", lambda v: v is None or (_is_number(v) and v > 0))
OPTIONAL_NUMBER = Field("null or a finite number", lambda v: v is None or _is_number(v))
LIST = Field("a list", lambda v: isinstance(v, list))
OBJECT = Field("an object", lambda v: isinstance(v, dict))
TEXT = Field("a string", lambda v: isinstance(v, str))

# A schema: a Field, a dict of schemas (the keys it must hold; a key ending in "?" may be missing),
# or a one-item list [schema] (a non-empty list whose every item matches schema).
Schema = Any


def stored_fields(doc: Any, schema: Schema, where: str) -> None:
    """Refuse ``doc`` (a stored results file, ``where``: its flag and path) unless it holds every
    field ``schema`` names, each as the schema says; the error names the first field that does not."""
    _check_fields(doc, schema, where, "")


def _check_fields(value: Any, schema: Schema, where: str, path: str) -> None:
    if isinstance(schema, Field):
        if not schema.ok(value):
            shown = json.dumps(value)[:60] if _jsonable(value) else repr(value)[:60]
            raise ConfigError(f"{where}: field {path} holds {shown}; need {schema.what}")
    elif isinstance(schema, dict):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: field {path or '(top)'} is not an object")
        for key, inner in schema.items():
            name, optional = key.rstrip("?"), key.endswith("?")
            if name not in value:
                if optional:
                    continue
                raise ConfigError(f"{where}: missing field {path + '.' if path else ''}{name}")
            _check_fields(value[name], inner, where, f"{path + '.' if path else ''}{name}")
    else:  # [item schema]
        if not isinstance(value, list) or not value:
            raise ConfigError(f"{where}: field {path} must be a non-empty list")
        for i, item in enumerate(value):
            _check_fields(item, schema[0], where, f"{path}[{i}]")


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


# ---- memory -----------------------------------------------------------------------------------------


def rank_fits(runs: Iterable[Any], rank: int, device: str, flags: str) -> None:
    """Refuse a benchmark that plays rank ``rank`` of each of ``runs`` (``RunConfig``) alone in this
    process (a ``LoopbackGroup``) when the largest of them cannot fit: the bound ``run`` checks
    (:func:`reference_impl.footprint.estimate`, that rank's process) against the free memory
    (:func:`reference_impl.footprint.free_bytes`). ``flags``: what the user can change, named in the error.

    CPU only: on a GPU the estimate's layer term is the torch paths' (what CPU ranks run), well above
    what the kernels hold; it would refuse runs that fit."""
    if device != "cpu":
        return
    from reference_impl import footprint

    need, largest = 0, None
    for run in runs:
        held = footprint.estimate(run, device, "inline").ranks[rank]
        if held > need:
            need, largest = held, run
    free = footprint.free_bytes(device)
    if largest is None or free is None or need <= free:
        return
    tokens = sum(r.total for r in largest.requests)
    raise ConfigError(
        f"{flags}: rank {rank} of C={largest.cp_size} at {tokens:,} tokens ({largest.preset}, {largest.model.n_layers} "
        f"layers) needs up to {need / GIB:,.1f} GiB on {device}, which has {free / GIB:,.1f} GiB free: use fewer "
        "tokens or layers, or a smaller preset"
    )
