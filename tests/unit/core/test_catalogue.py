"""tritonguard.core.catalogue: the one list of exported metrics, and docs/monitoring.md's table of it."""

from __future__ import annotations

from pathlib import Path

from tritonguard.core import catalogue
from tritonguard.triton.metrics import Metrics

DOC = Path(__file__).resolve().parents[3] / "docs" / "monitoring.md"


def test_the_docs_table_is_the_catalogue():
    text = DOC.read_text(encoding="utf-8")
    start, end = text.index(catalogue.BEGIN), text.index(catalogue.END) + len(catalogue.END)
    assert text[start:end] == catalogue.markdown(), \
        "docs/monitoring.md drifted: run .venv/bin/python -m tritonguard.core.catalogue --write docs/monitoring.md"


def test_every_family_has_one_name_one_type_and_a_help_text():
    families = catalogue.families()
    rows = catalogue._rows()
    assert all(name.startswith("tritonguard_") and doc for name, _, _, doc in rows)
    # one name may be exported by two kinds of guard, never as two types
    assert len(families) == len({(n, k) for n, k, _, _ in rows})
    assert families[catalogue.LATENCY] == "histogram" and families[catalogue.SERVED] == "counter"


def test_the_guard_registers_the_catalogues_families():
    assert Metrics.FAMILIES is catalogue.GUARD_COUNTERS and Metrics.GAUGES is catalogue.GUARD_GAUGES
    assert catalogue.guard_families() >= {catalogue.SERVED, catalogue.BREAKER, catalogue.LATENCY}
