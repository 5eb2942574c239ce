"""``exporter tune digits`` against the real tritonserver, with a tiny budget (3 points, one
concurrency, 500 ms windows): the report, the PNG, ``--apply`` writing a config and its backup,
and a config hand-edited while tune ran left as the user left it."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import typer
from typer.testing import CliRunner

from exporter.cli.tune_cmd import tune_command
from exporter.tune import sweep as tune
from tritonguard.core import repository

pytestmark = pytest.mark.functional


def _app():
    app = typer.Typer()
    app.command("tune")(tune_command)
    app.callback()(lambda: None)
    return app


def _tune_servers() -> list[str]:
    """tritonservers over a tune copy (``tritonguard-tune-<model>-…``) still running."""
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True, check=False).stdout
    return [line for line in out.splitlines() if "--model-repository=" in line and "tritonguard-tune-digits-" in line]


def test_tune_digits_report_apply_and_hand_edit(exported_repo, tmp_path, monkeypatch):
    # a private copy of the user's digits (rollout state included): --apply writes into it
    repo = tmp_path / "repo"
    for name in ("digits", "digits_raw"):
        shutil.copytree(exported_repo / name, repo / name, ignore=shutil.ignore_patterns(".latency"))
    if not (repo / "digits" / "rollout_state.json").exists():  # a fresh export: no server loaded it yet
        from exporter.rollout.route import RouteChange, apply  # noqa: PLC0415

        apply(repo, "digits", RouteChange(primary=repository.latest_version(repo / "digits_raw")), by="test")
    state_before = (repo / "digits" / "rollout_state.json").read_bytes()
    raw_cfg = repo / "digits_raw" / "config.pbtxt"
    edited = {}

    # the user edits digits_raw by hand while tune runs (after tune read it, before it applies)
    start = tune.Session.start

    def start_then_hand_edit(self, *a, **kw):
        start(self, *a, **kw)
        text = raw_cfg.read_text()
        assert "max_queue_delay_microseconds: 500" in text
        edited["text"] = text.replace("max_queue_delay_microseconds: 500", "max_queue_delay_microseconds: 400")
        raw_cfg.write_text(edited["text"])

    monkeypatch.setattr(tune.Session, "start", start_then_hand_edit)
    out = tmp_path / "out"
    # --min-gain -100: every measured step is kept, so the chosen point is the last one (2
    # instances, 2 threads) whatever the shared machine's noise; --no-confirm: apply it
    res = CliRunner().invoke(_app(), [
        "tune", "digits", "-r", str(repo), "--concurrency", "4", "--budget-points", "3", "--window-ms", "500",
        "--trials", "3", "--knobs", "guard.instances,target.threads", "--max-instances", "2", "--max-threads", "2",
        "--min-gain", "-100", "--no-confirm", "--p99-ms", "5000", "--out", str(out), "--apply"])
    assert not _tune_servers()  # the private server is gone
    assert "Traceback" not in res.output
    assert res.exit_code == 1, res.output  # digits_raw was not written

    report = json.loads((out / "tune_report.json").read_text())
    assert (out / "tune.png").stat().st_size > 1000
    assert report["model"] == "digits" and report["pipeline"]["placement"] == "inprocess"
    assert report["objective"] == {"kind": "throughput", "p99_ms": 5000.0, "min_throughput_pct": None,
                                   "min_gain_pct": -100.0, "text": "max throughput with p99 ≤ 5000 ms at every concurrency"}
    assert set(report["search_space"]["ladders"]) == {"guard.instances", "target.threads"}
    points = report["points"]
    assert [p["phase"] for p in points] == ["baseline", "search", "search"]
    assert all(p["status"] == "ok" and p["results"]["4"]["throughput"] > 0 and p["results"]["4"]["p99_ms"] > 0
               for p in points)
    base, chosen = report["baseline"], report["chosen"]
    assert base["id"] == 0 and base["knobs"]["guard.instances"] == 1 and base["knobs"]["target.threads"] == 1
    assert chosen["id"] == 2 and chosen["knobs"]["guard.instances"] == 2 and chosen["knobs"]["target.threads"] == 2
    assert [p["chosen"] for p in points] == [False, False, True]
    assert "★ chosen" in res.output

    applied = {a["model"]: a for a in report["applied"]}
    assert applied["digits"]["status"] == "written"
    backup = repo / "digits" / applied["digits"]["backup"].rsplit("/", 1)[-1]
    assert backup.exists() and "count: 1" in backup.read_text()
    guard = repository.read_config(repo / "digits")
    assert guard["instance_group"][0]["count"] == 2
    assert guard["parameters"] == repository.read_config(_as_dir(backup))["parameters"]  # all else kept
    # the hand-edited target: reported, kept as edited, no backup
    assert applied["digits_raw"]["status"] == "skipped" and "changed since tune read it" in applied["digits_raw"]["detail"]
    assert raw_cfg.read_text() == edited["text"]
    assert not list((repo / "digits_raw").glob("config.pbtxt.bak-*"))
    assert (repo / "digits" / "rollout_state.json").read_bytes() == state_before


def _as_dir(config_file):
    """read_config takes a folder: a temporary one holding ``config_file`` as config.pbtxt."""
    import tempfile
    from pathlib import Path

    d = Path(tempfile.mkdtemp())
    shutil.copy(config_file, d / "config.pbtxt")
    return d
