"""Issue 43 item 3: one exit-code table for every command. Each number of
:mod:`exporter.cli.exits` means one thing, each command reaches only those constants (found in
its code by tools/gen_reference.py), and an unexpected error is one line and exit 70, not a
traceback and exit 1 (which now means "the answer is no")."""

from __future__ import annotations

import importlib.util
import stat
import sys
from pathlib import Path

import pytest

from exporter.cli import app as app_mod
from exporter.cli import exits

ROOT = Path(__file__).resolve().parents[4]


def _gen():
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "tools" / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gen_reference", module)
    spec.loader.exec_module(module)
    return module


def test_every_number_has_one_name_and_a_meaning():
    gen = _gen()
    consts = gen.exit_constants()
    values = [code for code, _ in consts.values()]
    assert sorted(values) == sorted(exits.CODES) and len(set(values)) == len(values), consts
    assert all(doc for _, doc in consts.values()), consts
    assert (exits.EXIT_OK, exits.EXIT_NEGATIVE, exits.EXIT_BAD_INPUT, exits.EXIT_NOT_FINISHED,
            exits.EXIT_STOPPED, exits.EXIT_BUG) == (0, 1, 2, 3, 4, 70)


def test_the_commands_whose_codes_changed_reach_the_new_ones():
    """3 was 'records missing' in audit verify and 'the sweep failed' in tune; 1 was 'the job
    stopped' in batch and 'stopped on a fatal error' in stream."""
    codes = {path: {c for c, _ in found} for path, found in _gen().command_codes().items()}
    assert codes["audit verify"] == {1, 2}
    assert codes["tune"] == {1, 2, 4}
    assert codes["batch"] == {1, 2, 4}
    assert codes["stream"] == {2, 4}
    assert codes["promote"] == {1, 2, 3}
    assert all(c in exits.CODES for found in codes.values() for c in found), codes


def test_an_unexpected_error_is_one_line_exit_70_and_the_traceback_in_a_file(tmp_path, monkeypatch, capfd):
    def broken() -> tuple[str, str]:
        raise RuntimeError("boom while talking to redis://tg:hunter2@127.0.0.1:6379/0")

    monkeypatch.setenv("TRITONGUARD_HOME", str(tmp_path))
    monkeypatch.setattr(app_mod, "new_api_key", broken)
    monkeypatch.setattr(sys, "argv", ["exporter", "tenant-key", "acme"])
    with pytest.raises(SystemExit) as exited:
        app_mod.main()
    assert exited.value.code == exits.EXIT_BUG
    err = " ".join(capfd.readouterr().err.split())
    [crash] = (tmp_path / "crash").iterdir()
    assert "unexpected error (a bug, exit 70)" in err and "RuntimeError: boom" in err, err
    assert f"the traceback is in {crash}" in err and "Traceback" not in err, err
    assert "hunter2" not in err and "redis://tg:***@127.0.0.1" in err, err
    text = crash.read_text()
    assert text.startswith("python -m exporter tenant-key acme") and "Traceback" in text and "def broken" not in text
    assert "in broken" in text and stat.S_IMODE(crash.stat().st_mode) == 0o600


def test_a_command_that_exits_itself_keeps_its_code(monkeypatch, capfd):
    """SystemExit is not an error: a refusal (2) passes the crash handler untouched."""
    monkeypatch.setattr(sys, "argv", ["exporter", "tenant-key", "no spaces"])
    with pytest.raises(SystemExit) as exited:
        app_mod.main()
    assert exited.value.code == exits.EXIT_BAD_INPUT
    assert "unexpected error" not in capfd.readouterr().err


def test_the_help_says_where_the_table_is():
    from typer.testing import CliRunner  # noqa: PLC0415

    res = CliRunner().invoke(app_mod.app, ["--help"])
    assert res.exit_code == 0 and "docs/reference/exit-codes.md" in " ".join(res.output.split()), res.output
