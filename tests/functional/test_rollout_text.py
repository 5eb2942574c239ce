"""Canary routing on the text model: versions of an ensemble (tokenizer -> encoder).

The exporter writes one pinned ensemble per version (``minilm_raw_v<N>``) and the guard routes
to it by version; a good v2 shares traffic without tripping, a pulled-embedding v3 is caught by
the canary comparison (cosine) with every request still answered.
"""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import tritonclient.http as httpclient

from exporter.build.export import export
from exporter.rollout.route import RouteChange, apply
from tritonguard.core.repository import read_config, write_config
from tritonguard.ops.server import Server

pytestmark = pytest.mark.functional


@pytest.fixture(scope="module")
def text_rollout(tmp_path_factory):
    from examples import faults_text, minilm

    repo = tmp_path_factory.mktemp("text_repo")
    v = {"base": export(minilm.build(), name="minilm", repository=repo, source="examples.minilm:build").version}
    # the same weights again, on purpose: a candidate that must behave exactly as the base
    v["good"] = export(minilm.build(), name="minilm", repository=repo, source="examples.minilm:build",
                       force=True).version
    v["pulled"] = export(faults_text.pulled(), name="minilm", repository=repo,
                         source="examples.faults_text:pulled").version
    cfg = read_config(repo / "minilm_guard")  # the guard step of the public ensemble minilm
    params = {k: x["string_value"] for k, x in cfg["parameters"].items()}
    params.update({"target_version": str(v["base"]), "routing.poll_interval_s": "0.2",
                   "breaker.min_requests": "10", "breaker.min_compared": "10", "breaker.max_fail_rate": "0.05"})
    cfg["parameters"] = {k: {"string_value": x} for k, x in params.items()}
    write_config(repo / "minilm_guard", cfg)
    server = Server(repository=repo, log_path=tmp_path_factory.mktemp("text_logs") / "tritonserver.log")
    server.start(wait_models=["minilm", *(f"minilm_raw_v{n}" for n in v.values())])
    client = httpclient.InferenceServerClient(server.http_url, concurrency=8)
    yield {"repo": repo, "v": v, "client": client}
    client.close()
    server.stop()


def send(ctx, n: int):
    futures = []
    for i in range(n):
        inp = httpclient.InferInput("TEXT", [1, 1], "BYTES")
        inp.set_data_from_numpy(np.array([[f"request {i}: the canary sings {i % 7} times".encode()]], dtype=object))
        futures.append(ctx["client"].async_infer("minilm", [inp], outputs=[
            httpclient.InferRequestedOutput("EMBEDDING"), httpclient.InferRequestedOutput("SERVED_BY")]))
    out = []
    for f in futures:
        r = f.get_result()  # raises on any user-visible error
        out.append((r.as_numpy("EMBEDDING")[0], r.as_numpy("SERVED_BY")[0, 0].decode()))
    return out


def breaker(ctx, version):
    st = json.loads((ctx["repo"] / "minilm" / "rollout_state.json").read_text())
    return st.get("breakers", {}).get(str(version), {}).get("state", "closed")


def test_good_text_candidate_shares_traffic(text_rollout):
    ctx = text_rollout
    apply(ctx["repo"], "minilm", RouteChange(candidate=ctx["v"]["good"], share=0.5, shadow=0.5))
    time.sleep(0.5)
    out = send(ctx, 120)
    served = {s for _, s in out}
    assert served == {f"minilm_raw:{ctx['v']['base']}", f"minilm_raw:{ctx['v']['good']}"}, served
    assert all(abs(np.linalg.norm(e) - 1) < 1e-4 for e, _ in out)
    time.sleep(1.0)
    assert breaker(ctx, ctx["v"]["good"]) == "closed"


def test_pulled_text_candidate_is_caught(text_rollout):
    ctx = text_rollout
    v = ctx["v"]["pulled"]
    apply(ctx["repo"], "minilm", RouteChange(candidate=v, share=0.5, shadow=0.5))
    time.sleep(0.5)
    caught_after = None
    for k in range(1, 9):
        send(ctx, 30)
        time.sleep(0.3)
        if breaker(ctx, v) != "closed":
            caught_after = 30 * k
            break
    assert caught_after is not None, "pulled embeddings were not caught within 240 requests"
    time.sleep(0.5)
    served = {s for _, s in send(ctx, 40)}
    assert f"minilm_raw:{v}" not in served
    apply(ctx["repo"], "minilm", RouteChange(candidate=0, shadow=0.0))
