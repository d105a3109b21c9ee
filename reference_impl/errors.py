"""The errors a run ends with, at the bottom of the package so that every layer can raise them.

* :class:`ConfigError` (a ``ValueError``): input the reference implementation refuses, with a
  message that names the problem; the CLI prints one line and exits with 2.
* :class:`RankFailedError`: a rank raised, died or hung (:class:`RankTimeoutError`); the message
  names the rank; the CLI exits with 3.
* :class:`RunStopped`: the launching process got SIGTERM or SIGINT and stopped every rank; the CLI
  exits with 128 + the signal number.
"""

from __future__ import annotations

import signal


class ConfigError(ValueError):
    """A configuration or input that the reference implementation refuses, with the reason."""


class RankFailedError(RuntimeError):
    """A rank raised, died, or hung; the message names the rank (``.rank``) and what happened."""

    def __init__(self, message: str, rank: int = -1, remote_traceback: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.remote_traceback = remote_traceback


class RankTimeoutError(RankFailedError, TimeoutError):
    """The run did not finish within its timeout; the message names the rank(s) left behind."""


class RunStopped(RuntimeError):
    """The launching process received ``signum`` (SIGTERM, SIGINT) and stopped every rank."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}: every rank was stopped")
        self.signum = signum
