"""Rich consoles for the CLI that do not squeeze output into 80 columns when it is piped.

Rich sizes a console from the terminal, else ``$COLUMNS``, else 80: a table written to a CI log
or through ``| cat`` would wrap at 80 columns. :class:`WideConsole` keeps rich's behaviour on a
terminal and when ``$COLUMNS`` is set, and otherwise (the console's own file is not a terminal)
renders at :data:`PIPE_WIDTH` columns, so tables and lines keep their natural width. Decided at
every print, so a console whose stream is swapped (tests, redirection) follows it.
"""

from __future__ import annotations

import logging
from typing import Any

from rich.console import Console, ConsoleDimensions

from exporter.records.registry import default_uri

# wide enough that no table or message line of the CLI wraps; tables do not expand to it
PIPE_WIDTH = 1000


class WideConsole(Console):
    @property
    def piped(self) -> bool:
        """Rendering at :data:`PIPE_WIDTH`: not a terminal, no ``$COLUMNS``, no width given."""
        if self._width is not None or self.is_terminal or self.is_jupyter:
            return False
        columns = self._environ.get("COLUMNS")
        return not (columns is not None and columns.isdigit() and int(columns) > 0)  # rich reads $COLUMNS

    @property
    def size(self) -> ConsoleDimensions:
        dims = super().size
        return ConsoleDimensions(PIPE_WIDTH, dims.height) if self.piped else dims

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        self._width, self._height = new_size


def console(**kwargs: Any) -> WideConsole:
    """A :class:`WideConsole` (``stderr=True`` for the diagnostics console)."""
    return WideConsole(**kwargs)


def log_handler(console: WideConsole) -> logging.Handler:
    """Log records to ``console``: rich's handler on a terminal; when piped, plain lines
    (``WARNING  message``), as rich's handler pads every record to the console's width."""
    from rich.logging import RichHandler  # noqa: PLC0415

    if not (isinstance(console, WideConsole) and console.piped):
        return RichHandler(console=console, show_path=False, show_time=False)
    handler = logging.StreamHandler(console.file)
    handler.setFormatter(logging.Formatter("%(levelname)-8s %(message)s"))
    return handler


def where(console: Console, repository: Any, registry: bool = False) -> None:
    """Where a writing command writes, on ``console`` (stderr: stdout stays clean for --json):
    the repository as an absolute path and, when the command touches the registry, its URI."""
    from pathlib import Path  # noqa: PLC0415

    from rich.markup import escape  # noqa: PLC0415

    line = f"repository {Path(repository).resolve()}"
    if registry:

        line += f"\nregistry   {default_uri(repository)}"
    console.print(f"[dim]{escape(line)}[/]", soft_wrap=True)
