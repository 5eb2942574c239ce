"""examples.generator trains on the same documents in every process (issue 40: the suite's lanes
ran test_stream_guard after test_batch's Ray in one process, and tinylm's greedy answer to "x = "
became "are the" where the test, run alone, had it "an")."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from examples import generator as example

ROOT = Path(__file__).resolve().parents[3]
DIGEST = ("import hashlib, sys\n"
          "import ray  # changes a module the corpus reads: a document went missing\n"
          "from examples import generator as g\n"
          "print(hashlib.sha256('\\n'.join(g.corpus()).encode()).hexdigest())\n")


def test_the_corpus_does_not_depend_on_what_the_process_imported():
    import hashlib  # noqa: PLC0415

    here = hashlib.sha256("\n".join(example.corpus()).encode()).hexdigest()
    after_ray = subprocess.run([sys.executable, "-c", DIGEST], cwd=ROOT, capture_output=True, text=True,
                               check=True).stdout.strip()
    assert after_ray == here
    assert len(example.corpus()) > 1000


def test_weights_shared_through_the_train_cache_export_the_same_bytes(tmp_path):
    """$TRITONGUARD_TRAIN_CACHE (set by tests.lanes for the whole run): a second process loads
    what the first trained, and exports the very file a fresh training exports."""
    import torch  # noqa: PLC0415

    cache = tmp_path / "cache"
    trained, _, figures = example._train_shared(cache, 3, 5)
    assert len(list(cache.glob("tinylm-*.pt"))) == 1
    # what another process sees: the file, not this process's copy
    loaded, tok, again = example._train_shared(cache, 3, 5)
    assert loaded is not trained and again == figures and tok.vocab_size == trained.head.out_features
    for (name, a), (_, b) in zip(trained.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    fresh, _, _ = example._train(3, 5)
    assert example.export_onnx(loaded) == example.export_onnx(fresh)
    # another seed is another entry, not the first one's weights
    other, _, _ = example._train_shared(cache, 4, 5)
    assert len(list(cache.glob("tinylm-*.pt"))) == 2
    assert not torch.equal(other.head.weight, loaded.head.weight)
