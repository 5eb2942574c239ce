"""`exporter feedback` at the CLI boundary (label files in each format, exit codes, counts) and
the judge's operator-owned limits as promote resolves them (flag > judge.* of the guard's layers >
default, each named with its source)."""

from __future__ import annotations

import json
import time

import pandas as pd
import pytest
from typer.testing import CliRunner

from exporter.build.export import export
from exporter.cli.app import app
from exporter.cli.feedback_cmd import LabelFileError, read_labels
from exporter.rollout.guards import GuardSettingsError, judge_limits
from tests.unit.exporter.build.test_export import tiny_spec
from tritonguard.core.repository import read_config, write_config
from tritonguard.rollout.feedback import LABEL, MODEL, PRED, Prediction, open_feedback_log


@pytest.fixture
def repo(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITONGUARD_STATE_URL", raising=False)
    repo = tmp_path / "repo"
    export(tiny_spec(), name="tiny", repository=repo, source="t")
    log = open_feedback_log("tiny", repo)
    log.write(PRED, "w", 1, [Prediction("", f"r{i}", time.time(), 1, MODEL, (i % 3,)) for i in range(6)])
    return repo


def test_labels_from_csv_jsonl_and_parquet(tmp_path):
    (tmp_path / "l.csv").write_text("request_id,label,slice\nr0,0,a\nr1,2,\n")
    (tmp_path / "l.jsonl").write_text('{"request_id": "r0", "label": 0}\n\n{"request_id": "r1", "label": "2"}\n')
    pd.DataFrame({"request_id": ["r0", "r1"], "label": [0, 2]}).to_parquet(tmp_path / "l.parquet")
    for name in ("l.csv", "l.jsonl", "l.parquet"):
        rows = read_labels(tmp_path / name)
        assert [str(r["request_id"]) for r in rows] == ["r0", "r1"], name
    (tmp_path / "bad.csv").write_text("id,label\nr0,1\n")
    with pytest.raises(LabelFileError, match="row 1 has no request_id"):
        read_labels(tmp_path / "bad.csv")
    (tmp_path / "l.csv.gz").write_text("x")
    with pytest.raises(LabelFileError, match="expected .csv, .jsonl or .parquet"):
        read_labels(tmp_path / "l.csv.gz")


def test_feedback_joins_counts_and_exits_by_outcome(repo, tmp_path):
    (tmp_path / "l.csv").write_text("request_id,label\nr0,0\nr1,0\nzzz,1\n")
    res = CliRunner().invoke(app, ["feedback", "tiny", "--labels", str(tmp_path / "l.csv"), "--repository", str(repo),
                                   "--json"])
    assert res.exit_code == 0, res.output
    counts = json.loads(res.stdout)
    assert counts["joined"] == 2 and counts["unknown"] == 1 and counts["by_version"] == {"1": {"right": 1, "labelled": 2}}
    assert len(open_feedback_log("tiny", repo).read(LABEL)) == 2
    again = CliRunner().invoke(app, ["feedback", "tiny", "--labels", str(tmp_path / "l.csv"), "--repository", str(repo)])
    assert again.exit_code == 1 and "2 already joined" in again.stderr, again.output
    bad = CliRunner().invoke(app, ["feedback", "nosuch", "--labels", str(tmp_path / "l.csv"), "--repository", str(repo)])
    assert bad.exit_code == 2 and "'nosuch' is not a guarded model" in bad.stderr


def test_judge_limits_come_from_flags_then_the_guards_layers_then_defaults(repo, monkeypatch):
    limits = judge_limits(repo, "tiny")
    assert limits.max_disagreement == 0.02 and "genuine digits retrains" in limits.sources["max_disagreement"]
    cfg = read_config(repo / "tiny")
    cfg["parameters"]["judge.max_disagreement"] = {"string_value": "0.01"}
    write_config(repo / "tiny", cfg)
    limits = judge_limits(repo, "tiny")
    assert limits.max_disagreement == 0.01 and limits.sources["max_disagreement"] == \
        "judge.max_disagreement from config.pbtxt"
    monkeypatch.setenv("TRITONGUARD_JUDGE__MIN_COSINE", "0.8")
    limits = judge_limits(repo, "tiny", max_disagreement="3%")
    assert limits.max_disagreement == pytest.approx(0.03) and limits.sources["max_disagreement"] == "--max-disagreement"
    assert limits.min_cosine == 0.8 and "environment" in limits.sources["min_cosine"]
    with pytest.raises(GuardSettingsError, match="judge.max_disagreement must be in"):
        judge_limits(repo, "tiny", max_disagreement="0")
