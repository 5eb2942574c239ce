"""exporter.cli.stream_cmd: misuse is one line and exit 2, before any broker or Triton is touched."""

from __future__ import annotations

from typer.testing import CliRunner

from exporter.cli.app import app

BASE = ["stream", "--bootstrap", "127.0.0.1:1", "--topic", "in", "--output", "out", "--model", "digits"]


def test_a_bad_partitioning_or_offset_reset_is_refused_in_one_line():
    res = CliRunner().invoke(app, [*BASE, "--partition-by", "random"])
    assert res.exit_code == 2 and "--partition-by is 'input' or 'key'" in res.output
    res = CliRunner().invoke(app, [*BASE, "--offset-reset", "middle"])
    assert res.exit_code == 2 and "--offset-reset is 'earliest' or 'latest'" in res.output


def test_a_kafka_setting_must_be_key_equals_value():
    res = CliRunner().invoke(app, [*BASE, "--kafka", "security.protocol"])
    assert res.exit_code == 2 and "expected KEY=VALUE" in res.output


def test_a_kafka_setting_the_stream_owns_is_refused_naming_why():
    """--kafka passes librdkafka settings to both clients, but not the ones the delivery guarantee
    rests on (before, they were overridden without a word)."""
    res = CliRunner().invoke(app, [*BASE, "--kafka", "enable.auto.commit=true"])
    assert res.exit_code == 2 and "enable.auto.commit is set by the stream" in res.output
    res = CliRunner().invoke(app, [*BASE, "--kafka", "acks=1"])
    assert res.exit_code == 2 and "acks is set by the stream" in res.output


def test_the_command_is_registered_with_its_options():
    res = CliRunner().invoke(app, ["stream", "--help"])
    assert res.exit_code == 0
    for option in ("--max-batch", "--max-wait-ms", "--dlq", "--metrics-port", "--group"):
        assert option in res.output


def test_a_bad_replay_spec_is_refused_in_one_line(tmp_path):
    res = CliRunner().invoke(app, [*BASE, "--replay", "in:0:9-3"])
    assert res.exit_code == 2 and "the range ends before it starts" in res.output
    res = CliRunner().invoke(app, [*BASE, "--replay", "other:0:1-3"])
    assert res.exit_code == 2 and "not on the input topic 'in'" in res.output
    (tmp_path / "r.json").write_text("[]")
    res = CliRunner().invoke(app, [*BASE, "--replay", str(tmp_path / "r.json")])
    assert res.exit_code == 2 and "not a stream record" in res.output
