"""Griffe extension for the docs build: render rST roles in docstrings as Markdown code spans.

The package's docstrings use Sphinx roles (:class:`~a.b.C`, :func:`f`). mkdocstrings parses them as
Markdown, where the role prefix would show as literal text. This turns each role into a plain code
span (the last path component when the target starts with ``~``). It changes no source file.
"""

from __future__ import annotations

import re
from typing import Any

from griffe import Extension, Object

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|exc|obj|const):`(~?)([^`]+)`")


def _replace(match: re.Match[str]) -> str:
    short, target = match.group(1), match.group(2)
    return f"`{target.rsplit('.', 1)[-1] if short else target}`"


class RstRoles(Extension):
    """Rewrite rST roles in every docstring to code spans."""

    def on_instance(self, *, obj: Object, **kwargs: Any) -> None:  # noqa: ARG002 (griffe hook signature)
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(_replace, obj.docstring.value)
