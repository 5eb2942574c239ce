"""tritonguard.models.chain: the tokenizer -> encoder ensemble run in one process, on the
repository `make setup` exports (real tokenizer files and ONNX encoder, no Triton)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tritonguard.core.errors import ConfigError
from tritonguard.core.repository import read_config, write_config
from tritonguard.models.chain import Chain, runnable

ROOT = Path(__file__).resolve().parents[3]
REPO = ROOT / "model_repository"


def test_the_chain_answers_the_goldens_the_ensemble_answered():
    """The goldens of minilm_raw v1 were recorded from the exported ensemble's own steps: in
    process, the same texts give the same embeddings (one fused batch of all of them, padded to
    the longest: the attention mask keeps padding out of each row)."""
    chain = Chain(REPO, "minilm_raw_v1")
    assert chain.models() == [("minilm_tokenizer", 1), ("minilm_encoder", 1)]
    goldens = np.load(REPO / "minilm_raw" / "1" / "goldens.npz")
    out = chain.run({"TEXT": goldens["in__TEXT"].astype(object)}, ["EMBEDDING"])
    assert out["EMBEDDING"].shape == goldens["out__EMBEDDING"].shape
    np.testing.assert_allclose(out["EMBEDDING"], goldens["out__EMBEDDING"], atol=1e-4)
    # row by row (each text alone, no padding) agrees with the fused batch
    one = chain.run({"TEXT": goldens["in__TEXT"][3:4].astype(object)}, ["EMBEDDING"])["EMBEDDING"]
    np.testing.assert_allclose(one[0], out["EMBEDDING"][3], atol=1e-4)


def _repo_with(tmp_path: Path, ensemble: dict) -> Path:
    repo = tmp_path / "repo"
    repo.mkdir()
    for model in ("minilm_tokenizer", "minilm_encoder"):
        (repo / model).symlink_to(REPO / model)
    (repo / ensemble["name"]).mkdir()
    write_config(repo / ensemble["name"], ensemble)
    return repo


def test_steps_run_in_the_order_their_tensors_allow(tmp_path):
    cfg = read_config(REPO / "minilm_raw_v1")
    cfg["name"] = "swapped"
    cfg["ensemble_scheduling"]["step"].reverse()  # encoder listed first: Triton runs it second
    repo = _repo_with(tmp_path, cfg)
    chain = Chain(repo, "swapped")
    assert [m for m, _ in chain.models()] == ["minilm_tokenizer", "minilm_encoder"]
    texts = np.array([[b"the cat sat on the mat"], [b"a longer sentence about the weather today"]], dtype=object)
    np.testing.assert_allclose(chain.run({"TEXT": texts}, ["EMBEDDING"])["EMBEDDING"],
                               Chain(REPO, "minilm_raw_v1").run({"TEXT": texts}, ["EMBEDDING"])["EMBEDDING"],
                               atol=1e-5)


def test_a_step_reading_what_no_step_writes_is_refused(tmp_path):
    cfg = read_config(REPO / "minilm_raw_v1")
    cfg["name"] = "broken"
    cfg["ensemble_scheduling"]["step"][1]["input_map"]["input_ids"] = "token_ids"
    repo = _repo_with(tmp_path, cfg)
    with pytest.raises(ConfigError, match=r"ensemble 'broken': no step can run"):
        Chain(repo, "broken")


def test_an_ensemble_of_other_backends_says_which_step_cannot_run(tmp_path):
    # the public minilm ensemble runs the intake and the guard: not something to run in process
    assert runnable(REPO, read_config(REPO / "minilm")) == \
        "its step 'minilm_intake' uses backend 'intake' (in process: tokenizer, runtime)"
    assert runnable(REPO, read_config(REPO / "minilm_encoder")) == "'minilm_encoder' is not an ensemble"
    cfg = read_config(REPO / "minilm_raw_v1")
    cfg["name"] = "pinned"
    cfg["ensemble_scheduling"]["step"][1]["model_version"] = 9
    repo = _repo_with(tmp_path, cfg)
    with pytest.raises(ConfigError, match=r"step 'minilm_encoder' v9 is not in"):
        Chain(repo, "pinned")
