"""Unit tests: ``$TRITONGUARD_HOME`` (runtime files of the file store, object-store caches) in a
throw-away folder, never the venv's; and the process environment as each test found it.

Commands run in process (``CliRunner``) set variables the way a CLI process may (``--state-url``
becomes ``$TRITONGUARD_STATE_URL`` for everything the command opens); without the restore, one
test's Redis URL, dead after it, became every later test's store."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True)
def _tritonguard_home(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("TRITONGUARD_HOME", str(tmp_path_factory.getbasetemp() / "tritonguard-home"))


@pytest.fixture(autouse=True)
def _environment_restored():
    before = dict(os.environ)
    yield
    if os.environ != before:
        os.environ.clear()
        os.environ.update(before)
