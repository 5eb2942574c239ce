"""Unit tests: ``$TRITONGUARD_HOME`` (runtime files of the file store, object-store caches) in a
throw-away folder, never the venv's."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _tritonguard_home(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("TRITONGUARD_HOME", str(tmp_path_factory.getbasetemp() / "tritonguard-home"))
