"""docs/reference/ is what tools/gen_reference.py writes from the code today, and every environment
variable, exit code and guard key the code has is described there (issue 43 items 1 and 4)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "docs" / "reference"
RUN = "run `.venv/bin/python tools/gen_reference.py`"


def _load():
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "tools" / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gen_reference", module)
    spec.loader.exec_module(module)
    return module


gen = _load()


def test_the_reference_is_current(tmp_path):
    assert gen.main(["--out", str(tmp_path)]) == 0, "the generator's tables name what the code lacks (see stderr)"
    fresh = {p.name: p.read_text(encoding="utf-8") for p in tmp_path.iterdir()}
    kept = {p.name: p.read_text(encoding="utf-8") for p in REFERENCE.glob("*.md")}
    assert set(fresh) == set(gen.PAGES)
    stale = sorted(name for name in fresh.keys() | kept.keys() if fresh.get(name) != kept.get(name))
    assert not stale, f"docs/reference/{', '.join(stale)} stale: {RUN}"


def test_the_reference_names_no_machine_path():
    for name, text in gen.render().items():
        assert str(ROOT) not in text and "/home/" not in text and "/tmp/" not in text, name


def test_every_environment_variable_has_a_meaning():
    names, _ = gen.env_scan()
    # the scan sees the variables the code is known to read, so an empty result cannot pass
    assert {"TRITONGUARD_STATE_URL", "TRITONGUARD_NAMESPACE", "TRITONGUARD_REPOSITORY"} <= set(names)
    assert "tritonguard/rollout/stores.py" in names["TRITONGUARD_STATE_URL"]  # via the imported ENV_URL
    assert gen.env_problems() == [], f"describe them in tools/gen_reference.py, then {RUN}"


def test_a_new_variable_without_a_meaning_is_caught(tmp_path):
    for top in gen.SCANNED:
        (tmp_path / top).mkdir()
    (tmp_path / "exporter" / "knob.py").write_text(
        'import os\n\nENV = "TRITONGUARD_NEW_KNOB"\nvalue = os.environ.get(ENV, "")\n'
        'prefixed = {f"TRITONGUARD_{k}": 1 for k in "ab"}\n', encoding="utf-8")
    (tmp_path / "tritonguard" / "user.py").write_text("from exporter.knob import ENV\n", encoding="utf-8")
    names, patterns = gen.env_scan(tmp_path)
    assert names == {"TRITONGUARD_NEW_KNOB": {"exporter/knob.py", "tritonguard/user.py"}}
    problems = gen.env_problems(tmp_path)
    assert any(p.startswith("TRITONGUARD_NEW_KNOB ") for p in problems)
    assert any(p.startswith("exporter/knob.py builds TRITONGUARD_") for p in problems)


def test_every_exit_code_of_every_command_has_a_meaning():
    codes = gen.command_codes()
    assert set(codes) == {path for path, _ in gen.cli_commands()}
    # what the code is known to do: promote holds with 3 and rolls back with 1, audit verify's findings are 1
    assert {c for c, _ in codes["promote"]} >= {1, 2, 3}
    assert {c for c, _ in codes["audit verify"]} == {1, 2}
    assert gen.exit_problems() == [], f"name them in exporter/cli/exits.py, then {RUN}"


def test_each_code_has_one_row_whichever_command_exits_with_it():
    """Issue 43 item 3: 3 meant records missing (audit verify), still running (promote) and a
    failed sweep (tune); the page's table has one row, one meaning, per code."""
    head = gen.exit_codes_page().split("## By command", 1)[0]
    codes = [line.split("|")[1].strip() for line in head.splitlines() if line.startswith("| ") and line[2:3].isdigit()]
    assert {"0", "1", "2", "3", "4", "70"} <= set(codes) and len(codes) == len(set(codes)), codes


def test_every_guard_key_has_a_meaning_and_day_one_comes_first():
    assert gen.guard_key_problems() == [], f"comment the field or add a FIELD_MEANINGS line, then {RUN}"
    keys = {k.key for _, _, ks in gen.guard_sections() for k in ks}
    assert {"target", "cache.enabled", "breaker.window", "validation.range.<NAME>"} <= keys
    page = gen.guard_config_page()
    assert page.index("### Day one") < page.index("### Tuning: every key")


def test_a_stale_day_one_list_stops_the_generator(monkeypatch):
    monkeypatch.setitem(gen.GUARD_DAY_ONE, "cache.no_such_key", "a key the code lacks")
    with pytest.raises(gen.ReferenceError, match="cache.no_such_key"):
        gen.guard_config_page()
