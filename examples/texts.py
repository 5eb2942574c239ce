"""Varied real text that ships offline, for load tests and tuning: first lines of the standard
library's docstrings (the sentences ``perf/soak.py`` and ``exporter tune`` send to ``minilm``)."""

from __future__ import annotations

import inspect
import pydoc
import random

MODULES = ("os", "json", "re", "collections", "itertools", "functools", "pathlib", "threading",
           "subprocess", "statistics", "textwrap", "string", "shutil", "random", "datetime")
FALLBACK = "Canary releases send a small share of traffic to a new model version first."


def stdlib_sentences(n: int, seed: int = 0) -> list[str]:
    """``n`` sentences: distinct ones in a seeded order, repeated from the start when ``n``
    exceeds how many there are."""
    out: list[str] = []
    for mod in MODULES:
        try:
            module = pydoc.locate(mod)
        except pydoc.ErrorDuringImport:
            continue
        for _, obj in inspect.getmembers(module):
            line = (inspect.getdoc(obj) or "").strip().split("\n")[0].strip()
            if 12 < len(line) < 300:
                out.append(line)
    out = list(dict.fromkeys(out)) or [FALLBACK]
    random.Random(seed).shuffle(out)
    return (out * (n // len(out) + 1))[:n]
