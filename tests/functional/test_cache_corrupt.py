"""A corrupt L2 file must not block startup (issue 12, item 4).

A real tritonserver serves the `digits` guard with the encrypted L2 cache on (two instances, so
two processes open the same SQLite file at once). The server is stopped, the first page of the
L2 file is overwritten with garbage, and the server is started again: the guard must load, move
the bad file aside exactly once, count it, and cache in a fresh file.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
import urllib.request

import numpy as np
import pytest
import tritonclient.http as httpclient

from tritonguard.core.repository import read_config, write_config
from tritonguard.ops.server import Server

pytestmark = pytest.mark.functional

KEY_HEX = "5a" * 32
METRIC = "tritonguard_cache_quarantined_total"


@pytest.fixture
def setup(exported_repo, tmp_path):
    repo, l2 = tmp_path / "repo", tmp_path / "data" / "l2" / "cache.sqlite"
    repo.mkdir()
    (repo / "digits_raw").symlink_to((exported_repo / "digits_raw").resolve())
    # guards write their rollout state beside their config: copy, keep the source clean
    shutil.copytree(exported_repo / "digits", repo / "digits",
                    ignore=shutil.ignore_patterns("rollout_state.json*", ".rollout_state*"))
    cfg = read_config(repo / "digits")
    cfg["instance_group"] = [{"kind": "KIND_CPU", "count": 2}]
    # no L1: a repeated request can only hit through L2
    for k, v in {"cache.enabled": "true", "cache.privacy": "persisted_encrypted", "cache.l2_path": str(l2),
                 "cache.l1_entries": "0"}.items():
        cfg["parameters"][k] = {"string_value": v}
    write_config(repo / "digits", cfg)
    env = {**os.environ, "TRITONGUARD_L2_ENCRYPTION_KEY": KEY_HEX}
    return {"repo": repo, "l2": l2, "env": env, "logs": tmp_path / "logs"}


def _serve(setup, run):
    return Server(repository=setup["repo"], log_path=setup["logs"] / f"tritonserver.{run}.log", env=setup["env"])


def _infer(server, x):
    outs = [httpclient.InferRequestedOutput("PROBS"), httpclient.InferRequestedOutput("SERVED_BY")]
    with contextlib.closing(httpclient.InferenceServerClient(server.http_url)) as c:
        inp = httpclient.InferInput("IMAGE", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        r = c.infer("digits", [inp], outputs=outs)
        raw_in = httpclient.InferInput("IMAGE", list(x.shape), "FP32")
        raw_in.set_data_from_numpy(x)
        raw = c.infer("digits_raw", [raw_in], outputs=[httpclient.InferRequestedOutput("PROBS")])
    return r.as_numpy("PROBS"), {s.decode() for s in r.as_numpy("SERVED_BY")[:, 0]}, raw.as_numpy("PROBS")


def _quarantined(server, timeout=15.0):
    """Sum of the quarantine counter over the guard's instances, once it shows (flushed every 1 s)."""
    deadline, total = time.monotonic() + timeout, 0.0
    while time.monotonic() < deadline:
        text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
        lines = [ln for ln in text.splitlines() if ln.startswith(METRIC + "{") and 'model="digits"' in ln]
        total = sum(float(ln.rsplit(" ", 1)[1]) for ln in lines if 'tier="l2"' in ln)
        if total:
            return total
        time.sleep(0.2)
    return total


def test_corrupt_l2_file_is_quarantined_and_digits_serves(setup):
    from sklearn.datasets import load_digits

    x = load_digits().images[:4].astype(np.float32)
    with _serve(setup, 1) as server:
        server.start(wait_models=("digits",))
        probs, served, _ = _infer(server, x)
        assert served == {"digits_raw:1"}
    l2 = setup["l2"]
    assert l2.stat().st_size > 4096, "the first run filled the L2 file"

    garbage = os.urandom(4096)
    with open(l2, "r+b") as f:  # the first page: the header and the schema's root
        f.write(garbage)
    with _serve(setup, 2) as server:
        server.start(wait_models=("digits",), timeout=120)
        got, served, raw = _infer(server, x)
        np.testing.assert_array_equal(got, raw)
        np.testing.assert_array_equal(got, probs)
        assert served == {"digits_raw:1"}, "the fresh L2 starts empty"
        again, served, _ = _infer(server, x)
        assert served == {"cache:digits_raw:1"}, "the fresh L2 caches (there is no L1)"
        np.testing.assert_array_equal(again, raw)
        assert _quarantined(server) == 1, "two instances opened the bad file: one quarantine, counted once"
        log = server.log_path.read_text(errors="replace")
    bad = sorted(p.name for p in l2.parent.iterdir() if p.name.startswith(l2.name + ".corrupt-"))
    assert [n for n in bad if not n.endswith(("-wal", "-shm"))] == [bad[0]], bad
    assert (l2.parent / bad[0]).read_bytes()[:4096] == garbage, "moved aside, not deleted"
    assert "quarantined" in log and str(l2) in log
