"""The exit codes of ``python -m exporter``: one table for every command, each number meaning one
thing whichever command exits with it, so a script (a CI step, a Kubernetes Job, a shell loop)
can act on the number without knowing the command (issue 43 item 3).

The numbers follow what a shell user already reads into them: 0 done, 1 done and the answer is
no (``grep``, ``diff``), 2 refused before anything happened (usage: Click's own code), then the two
states a long-running command can end in that are neither (3 not finished yet, 4 stopped part
way), 70 for a bug (``EX_SOFTWARE`` of sysexits.h) and 130 for Ctrl-C (128 + SIGINT). What
kind of "no" or which refusal it was is said in one line on stderr (and in ``--json`` where a
command has it), never by a different number.

Every ``raise typer.Exit(…)`` of a command names one of these constants; each constant's
docstring is its meaning in docs/reference/exit-codes.md, which ``tools/gen_reference.py``
writes from this module (and fails on a code a command reaches that is not here).
"""

from __future__ import annotations

from exporter.errors import EXIT_BAD_INPUT as _LIBRARY_BAD_INPUT

EXIT_OK = 0
"""Done: the command did what it was asked (a promotion completed, a log verified intact, every
row scored exactly once)."""

EXIT_NEGATIVE = 1
"""Ran to the end, and the answer is no: the candidate was rolled back or the rollout aborted, a
golden check failed, a verification found a problem (tampering, a truncation, gaps), no label
could be joined, ``--apply`` wrote nothing. The kind is named on stderr."""

# (the library's errors carry it as their ``exit_code``: defined with them in exporter.errors)
EXIT_BAD_INPUT = _LIBRARY_BAD_INPUT
"""Refused before doing anything: a usage error (an unknown option, a missing argument, a value
of the wrong type), a bad file or configuration, a state that does not allow it (a model that is
not guarded, a replica that cannot be reached), named in one line on stderr. Nothing was changed."""

EXIT_NOT_FINISHED = 3
"""Not finished: the rollout is still running or paused (``--no-wait``, a pause, a step waiting
for approval). Nothing failed; run ``rollout resume`` (or the command) again later."""

EXIT_STOPPED = 4
"""Stopped part way on an error met while running (servers gone longer than the retry timeout, a
worker died, the broker lost a result, the server under test failed). What it finished stands:
run the same command again (``batch`` and ``stream`` resume where they stopped; ``tune`` starts
over)."""

EXIT_BUG = 70
"""An unexpected error: a bug (``EX_SOFTWARE``). One line on stderr names it and the file its
traceback was written to; please report both."""

EXIT_INTERRUPTED = 130
"""Interrupted by Ctrl-C (SIGINT) in a command that does not stop on it by itself (``stream`` and
``status --watch`` do, and exit 0)."""

CODES = (EXIT_OK, EXIT_NEGATIVE, EXIT_BAD_INPUT, EXIT_NOT_FINISHED, EXIT_STOPPED, EXIT_BUG, EXIT_INTERRUPTED)

__all__ = ["CODES", "EXIT_BAD_INPUT", "EXIT_BUG", "EXIT_INTERRUPTED", "EXIT_NEGATIVE", "EXIT_NOT_FINISHED",
           "EXIT_OK", "EXIT_STOPPED"]
