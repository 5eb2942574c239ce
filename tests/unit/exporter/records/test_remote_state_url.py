"""``--state-url`` counts as the Redis store of a command on an object-store repository: the
repository wrapper checks for the state store before the command body runs (before, it looked at
``$TRITONGUARD_STATE_URL`` only, so ``status --state-url redis://… -r s3://…`` was refused)."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from exporter.cli.app import app
from tests.unit.exporter.records.test_remote import _record_puts, _seed


def test_status_takes_the_state_url_option_for_an_object_store(aws_env, tmp_path, monkeypatch, redis_server):
    monkeypatch.setenv("TRITONGUARD_HOME", str(tmp_path / "home"))
    # absent, and put back absent after the test (the option sets it for the process)
    monkeypatch.setenv("TRITONGUARD_STATE_URL", "unset")
    monkeypatch.delenv("TRITONGUARD_STATE_URL")
    bucket = aws_env.bucket("state-url-option")
    _seed(aws_env.client(), bucket)
    res = CliRunner().invoke(app, ["status", "--json", "-r", f"s3://{bucket}/repo", "--state-url", redis_server.url])
    assert res.exit_code == 0, res.output
    assert "set TRITONGUARD_STATE_URL" not in res.output
    assert [g["model"] for g in json.loads(res.stdout)["guards"]] == ["digits"]


def test_status_never_publishes(aws_env, tmp_path, monkeypatch, redis_server):
    """A store an older exporter wrote (its configs name no versions): ``status`` and ``rollout
    status`` show it as it is and send nothing (a writing command would pin the configs)."""
    import boto3

    monkeypatch.setenv("TRITONGUARD_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TRITONGUARD_STATE_URL", redis_server.url)
    bucket = aws_env.bucket("status-reads")
    _seed(aws_env.client(), bucket)
    client = boto3.client("s3")
    sent = _record_puts(client)
    monkeypatch.setattr("tritonguard.core.objectstore.client", lambda _spec: client)
    for args in (["status", "--json"], ["rollout", "status", "digits"]):
        res = CliRunner().invoke(app, [*args, "-r", f"s3://{bucket}/repo"])
        assert res.exit_code in (0, 1), res.output
        assert "Traceback" not in res.output
    assert sent == []
    config = aws_env.client().get_object(Bucket=bucket, Key="repo/digits_raw/config.pbtxt")["Body"].read()
    assert b"specific" not in config
