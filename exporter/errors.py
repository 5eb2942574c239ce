"""The one root of the exporter's errors: a command catches :class:`ExporterError`, prints its
message in one line and exits with its ``exit_code`` (2, bad input, unless a subclass says
otherwise). Every plane of the exporter raises subclasses of it; errors of tritonguard's own
(a guard's bad parameter, an unreachable store) are turned into one where the exporter calls it.
"""

from __future__ import annotations

EXIT_BAD_INPUT = 2


class ExporterError(Exception):
    """Reported in one line; the command exits with ``exit_code``."""

    exit_code = EXIT_BAD_INPUT


class BadInput(ExporterError, ValueError):
    """A flag or argument out of its range (a ValueError too, for callers that parse values)."""


__all__ = ["EXIT_BAD_INPUT", "BadInput", "ExporterError"]
