"""examples.training: the digits CNN trained once for every process that shares
$TRITONGUARD_TRAIN_CACHE (as tinylm is: tests/unit/examples/test_generator.py), on a pinned
thread count that the caller gets back."""

from __future__ import annotations

import torch

from examples import candidates, digits, training


def test_digits_weights_shared_through_the_train_cache_are_a_fresh_trainings(tmp_path):
    cache = tmp_path / "cache"
    trained, metrics = digits._train_shared(cache, 3, 2)
    assert len(list(cache.glob("digits-*.pt"))) == 1
    # what another process sees: the file, not this process's objects
    loaded, again = digits._train_shared(cache, 3, 2)
    assert loaded is not trained and again == metrics
    fresh, fresh_metrics = digits._train(3, 2)
    assert fresh_metrics == metrics
    for (name, a), (_, b), (_, c) in zip(trained.state_dict().items(), loaded.state_dict().items(),
                                         fresh.state_dict().items(), strict=True):
        assert torch.equal(a, b) and torch.equal(a, c), name
    a, b = candidates.write_onnx(loaded, tmp_path / "a.onnx"), candidates.write_onnx(fresh, tmp_path / "b.onnx")
    assert a.read_bytes() == b.read_bytes()
    # another seed is another entry, not the first one's weights
    other, _ = digits._train_shared(cache, 4, 2)
    assert len(list(cache.glob("digits-*.pt"))) == 2
    assert not torch.equal(other.head[1].weight, loaded.head[1].weight)


def test_a_training_runs_on_the_pinned_threads_and_gives_the_callers_back(monkeypatch):
    seen = []
    monkeypatch.setattr(digits, "_split", _recording(digits._split, seen))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        digits._train(0, 1)
        assert seen == [training.THREADS]
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_in_one_process_a_second_call_is_a_copy_of_the_first(monkeypatch, tmp_path):
    monkeypatch.delenv(training.TRAIN_CACHE_ENV, raising=False)
    monkeypatch.setattr(digits, "_TRAINED", {})
    calls = []
    real = digits._train
    monkeypatch.setattr(digits, "_train", lambda seed, epochs: calls.append((seed, epochs)) or real(seed, epochs))
    a, x_te, y_te, metrics = digits.train_with_metrics(5, 1)
    b, _, _, again = digits.train_with_metrics(5, 1)
    assert calls == [(5, 1)] and a is not b and again == metrics and len(y_te) == len(x_te) == 450
    assert torch.equal(a.head[1].weight, b.head[1].weight)


def _recording(fn, seen):
    def wrapped():
        seen.append(torch.get_num_threads())
        return fn()
    return wrapped
