"""The one error type for input the reference implementation refuses.

:class:`ConfigError` (a ``ValueError``) carries a message that names the problem; the CLI turns it
into one line on stderr and exit code 2. It lives at the bottom of the package so that every layer
can raise it.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration or input that the reference implementation refuses, with the reason."""
