"""One repair to the Triton CPU interpreter, applied when the kernels are interpreted.

Triton before 3.7 gives an interpreted scalar (a runtime ``int`` argument such as ``topk``) an
``__index__`` that calls ``int()`` on a one-element 1-D NumPy array. NumPy 2.x refuses that
("only 0-dimensional arrays can be converted to Python scalars"), so a ``tl.range`` bounded by a
runtime argument fails under ``TRITON_INTERPRET=1`` with triton 3.6 (the H200 image's) and works
with 3.7 (this project's CPU pin), which squeezes the array first. :func:`apply` makes older
interpreters do the same; it changes nothing on a compiled GPU run or on triton >= 3.7.
"""

from __future__ import annotations

import os
from typing import Any

_TRUE = ("1", "true", "yes", "on")


def interpreting() -> bool:
    """Whether Triton kernels run under the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in _TRUE


def apply() -> bool:
    """Give the interpreter's scalar tensors a NumPy-2-safe ``__index__``; True when it patched."""
    if not interpreting():
        return False
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_squeezes_scalars", False):
        return False

    def patch_lang_tensor(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patch_lang_tensor._squeezes_scalars = True  # type: ignore[attr-defined]
    patch_lang_tensor.__wrapped__ = original  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patch_lang_tensor
    return True


apply()
