"""Versioned tinylm exports (manifest, goldens, eval set) and the offline judge of generative
versions (exporter.rollout.generation) on real trained models: a degraded checkpoint fails the task
judge, an honest retrain passes it, a re-export of the same checkpoint is byte-identical and
passes the equivalence judge."""

from __future__ import annotations

import hashlib
import json
import math
import shutil

import numpy as np
import pytest

from examples import generator as example
from exporter.rollout.generation import judge_generation
from exporter.rollout.judge import FAIL, PASS, JudgeError, manifest_judge
from tritonguard.core.config import model_parameters
from tritonguard.core.repository import read_config, read_manifest
from tritonguard.generation.decoder import CharTokenizer, StepModel
from tritonguard.guard.stream.config import parse_settings

DEGRADED_STEPS = 40
V1, DEGRADED, RETRAIN, REEXPORT, SLIGHT = 1, 2, 3, 4, 5
SLIGHT_STEPS = 150  # three quarters of the training: a few percent worse, not a wreck


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    """v1 (defaults), v2 degraded (40 steps), v3 another seed, v4 v1 again; a guard in front."""
    root = tmp_path_factory.mktemp("genjudge")
    figures = {
        V1: example.build(root, "tinylm", version=V1, guard="tinylm_guard"),
        DEGRADED: example.build(root, "tinylm", version=DEGRADED, steps=DEGRADED_STEPS),
        RETRAIN: example.build(root, "tinylm", version=RETRAIN, seed=1),
        REEXPORT: example.build(root, "tinylm", version=REEXPORT),
        SLIGHT: example.build(root, "tinylm", version=SLIGHT, steps=SLIGHT_STEPS),
    }
    return root, figures


def _manifest(root, v):
    return read_manifest(root / "tinylm" / str(v))


# -- the export ----------------------------------------------------------------------------------
def test_version_folder_and_manifest(repo):
    root, figures = repo
    folder = root / "tinylm" / "1"
    assert sorted(p.name for p in folder.iterdir()) == [
        "eval.json", "goldens.json", "manifest.json", "model.onnx", "vocab.json"]
    m = _manifest(root, V1)
    assert m["format_version"] == 1 and m["name"] == "tinylm" and m["version"] == 1
    assert m["artifact"] == "model.onnx" and m["format"] == "onnx" and m["task"] == "generation"
    assert m["source"] == "examples.generator:build" and m["created"].endswith("+00:00")
    assert m["sha256"] == hashlib.sha256((folder / "model.onnx").read_bytes()).hexdigest()
    assert m["training"]["seed"] == example.SEED and m["training"]["steps"] == example.STEPS
    assert m["training"]["documents"] == len(example.split(example.corpus())[0])
    assert m["golden"] == {"verdict": "PASS", "n": 12, "metrics": {"exact": 1.0}}
    ev = m["evaluation"]
    assert ev["metric"] == "bits_per_char" and math.isfinite(ev["value"])
    assert ev["value"] == pytest.approx(figures[V1]["bits_per_char"])
    assert ev["sha256"] == hashlib.sha256((folder / "eval.json").read_bytes()).hexdigest()
    texts = json.loads((folder / "eval.json").read_text())["texts"]
    assert ev["docs"] == len(texts) and ev["n"] == sum(len(t) for t in texts)
    # judges: a new training run is judged on the task, the same bytes again on equivalence
    assert [_manifest(root, v)["judge"] for v in (V1, DEGRADED, RETRAIN, REEXPORT)] == [
        "task", "task", "task", "equivalence"]
    assert manifest_judge(root, "tinylm", REEXPORT) == "equivalence"
    assert manifest_judge(root, "tinylm", RETRAIN) == "task"


def test_reexport_is_byte_identical(repo):
    root, _ = repo
    a, b = (root / "tinylm" / str(v) / "model.onnx" for v in (V1, REEXPORT))
    assert a.read_bytes() == b.read_bytes()
    assert _manifest(root, V1)["sha256"] == _manifest(root, REEXPORT)["sha256"] != _manifest(root, RETRAIN)["sha256"]
    assert _manifest(root, REEXPORT)["evaluation"]["value"] == _manifest(root, V1)["evaluation"]["value"]


def test_goldens_are_what_the_backend_decoder_answers(repo):
    root, _ = repo
    folder = root / "tinylm" / "1"
    cases = json.loads((folder / "goldens.json").read_text())
    assert cases["format_version"] == 1
    cases = cases["cases"]
    greedy = [c for c in cases if c["sampling"]["temperature"] == 0]
    sampled = [c for c in cases if c["sampling"]["temperature"] != 0]
    assert len(greedy) == 8 and len(sampled) == 4
    assert len({c["prompt"] for c in greedy}) == 8
    assert all(c["sampling"] == {"max_tokens": 48, "temperature": 0} for c in greedy)
    assert sorted(c["sampling"]["seed"] for c in sampled) == [0, 1, 2, 3]
    assert all(c["sampling"]["top_p"] == 0.95 and c["sampling"]["temperature"] == 0.8 for c in sampled)
    tok = CharTokenizer.from_dict(json.loads((folder / "vocab.json").read_text()))
    for _ in range(2):  # a fresh session each time: decoding is deterministic
        dec = example.decoder(folder / "model.onnx", tok)
        assert [example.generate_case(dec, c) for c in cases] == [c["text"] for c in cases]
    assert all(0 < len(c["text"]) <= 48 and not c["text"].startswith(c["prompt"]) for c in greedy[:1])


def test_eval_split_is_held_out_of_training_and_shared_by_every_version(repo):
    root, _ = repo
    docs = example.corpus()
    train_docs, held = example.split(docs)
    assert held and not set(train_docs) & set(held) and len(train_docs) + len(held) == len(docs)
    assert all(example.held_out(d) for d in held) and not any(example.held_out(d) for d in train_docs)
    texts = json.loads((root / "tinylm" / "1" / "eval.json").read_text())["texts"]
    assert texts == example.eval_texts(docs)
    assert 0 < len(texts) <= example.EVAL_MAX_TEXTS and all(0 < len(t) <= example.EVAL_CHARS for t in texts)
    assert all(any(d.startswith(t) for d in held) for t in texts)
    assert not any(d.startswith(t) for t in texts for d in train_docs)
    shas = {_manifest(root, v)["evaluation"]["sha256"] for v in (V1, DEGRADED, RETRAIN, REEXPORT)}
    assert len(shas) == 1  # whatever the seed or steps: the same held-out texts


def test_bits_per_char_on_trivial_texts(repo):
    root, _ = repo
    onnx = root / "tinylm" / "1" / "model.onnx"
    tok = CharTokenizer()
    model = StepModel(onnx)

    def alone(text):  # one text, unbatched: -log2 p of each character after EOS
        state, bits, prev = model.zeros(1), 0.0, tok.eos
        for t in tok.encode(text):
            logits, state = model.run(np.array([[prev]], np.int64), state)
            z = logits[0].astype(np.float64)
            bits -= (z[t] - z.max() - np.log(np.exp(z - z.max()).sum())) / np.log(2)
            prev = t
        return bits

    value, n = example.bits_per_char(onnx, ["a"])
    assert n == 1 and value == pytest.approx(alone("a"), rel=1e-5)
    texts = ["the", "Return the string.", "x"]  # padding: shorter rows are masked
    value, n = example.bits_per_char(onnx, texts)
    assert n == sum(map(len, texts))
    assert value == pytest.approx(sum(alone(t) for t in texts) / n, rel=1e-5)
    assert 0 < value < math.log2(tok.vocab_size)
    with pytest.raises(ValueError, match="non-empty"):
        example.bits_per_char(onnx, [""])


def test_guard_config_is_loadable(repo):
    root, _ = repo
    guard, target = read_config(root / "tinylm_guard"), read_config(root / "tinylm")
    # the guard's version folder holds only its placeholder manifest (object stores have no empty folders)
    assert [p.name for p in (root / "tinylm_guard" / "1").iterdir()] == ["manifest.json"]
    assert json.loads((root / "tinylm_guard" / "1" / "manifest.json").read_text())["placeholder"] is True
    assert guard["backend"] == "guard" and guard["model_transaction_policy"] == {"decoupled": True}
    assert guard.get("max_batch_size", 0) == 0
    assert guard["input"] == target["input"] and guard["output"] == target["output"]
    params = model_parameters(guard)
    assert params["target"] == "tinylm"
    settings = parse_settings(params, model="tinylm_guard")
    assert settings.validation.max_tokens == example.MAX_TOKENS_CAP
    # the target loads every version, so a rollout can route to several side by side
    assert target["version_policy"] == {"all": {}} and target["backend"] == "generator"
    shape = example.stream_guard_config("g", "t", validation__max_tokens=64)
    assert shape["parameters"] == {"target": {"string_value": "t"}, "validation.max_tokens": {"string_value": "64"}}


# -- the judge -----------------------------------------------------------------------------------
def test_degraded_checkpoint_fails_the_task_judge(repo):
    root, _ = repo
    res = judge_generation(root, "tinylm", V1, DEGRADED, judge="task")
    assert res.verdict == FAIL and "worse on the task" in res.reason
    assert res.bits_per_char["candidate"] > res.bits_per_char["primary"] * 1.03
    assert "bits/char" in res.summary()


def test_slightly_undertrained_checkpoint_fails_the_task_judge(repo):
    """150 of 200 steps: measured +8.9 % bits per char, against the retrains' spread of < 1 %."""
    root, _ = repo
    res = judge_generation(root, "tinylm", V1, SLIGHT, judge="task")
    ratio = res.bits_per_char["candidate"] / res.bits_per_char["primary"]
    assert res.verdict == FAIL and "worse on the task" in res.reason, res.summary()
    assert 1.03 < ratio < 1.20, ratio  # a modest regression, caught


def test_retrain_passes_the_task_judge_but_is_no_equivalent(repo):
    root, _ = repo
    res = judge_generation(root, "tinylm", V1, RETRAIN, judge="task")
    assert res.verdict == PASS, res.summary()
    assert res.rows >= 100 and 0 < res.disagreement <= res.expected_disagreement <= 1
    assert judge_generation(root, "tinylm", V1, RETRAIN, judge="equivalence").verdict == FAIL


def test_reexport_passes_the_equivalence_judge(repo):
    root, _ = repo
    res = judge_generation(root, "tinylm", V1, REEXPORT, judge="equivalence")
    assert res.verdict == PASS and res.disagreement == 0.0, res.summary()
    assert res.bits_per_char["candidate"] == res.bits_per_char["primary"]
    assert res.expected_disagreement < 0.03


def test_equivalence_failure_names_the_prompt(repo):
    root, _ = repo
    res = judge_generation(root, "tinylm", V1, DEGRADED, judge="equivalence")
    assert res.verdict == FAIL and "not equivalent" in res.reason and "first 'Return the'" in res.reason


def test_no_eval_data_is_a_judge_error(repo, tmp_path):
    root, _ = repo
    for v in (V1, DEGRADED):
        shutil.copytree(root / "tinylm" / str(v), tmp_path / "tinylm" / str(v))
        (tmp_path / "tinylm" / str(v) / "eval.json").unlink()
    with pytest.raises(JudgeError, match="eval.json"):
        judge_generation(tmp_path, "tinylm", V1, DEGRADED, judge="task")
    # the primary's eval set serves when the candidate has none
    shutil.copy(root / "tinylm" / "1" / "eval.json", tmp_path / "tinylm" / "1" / "eval.json")
    assert "eval.json of v1" in judge_generation(tmp_path, "tinylm", V1, DEGRADED, judge="task").data


def test_a_candidate_that_cannot_run_fails(repo, tmp_path):
    root, _ = repo
    for v in (V1, DEGRADED):
        shutil.copytree(root / "tinylm" / str(v), tmp_path / "tinylm" / str(v))
    (tmp_path / "tinylm" / "2" / "model.onnx").write_bytes(b"not onnx")
    res = judge_generation(tmp_path, "tinylm", V1, DEGRADED, judge="task")
    assert res.verdict == FAIL and "v2 cannot run" in res.reason
    with pytest.raises(JudgeError, match="v2 cannot run"):
        judge_generation(tmp_path, "tinylm", DEGRADED, V1, judge="task")
    with pytest.raises(ValueError, match="judge must be"):
        judge_generation(tmp_path, "tinylm", V1, DEGRADED, judge="accuracy")
