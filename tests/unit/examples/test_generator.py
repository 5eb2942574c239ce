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
