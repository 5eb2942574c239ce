"""The tinylm generator on a real tritonserver: generate, generate_stream (SSE), gRPC streaming,
bad inputs, concurrent requests and a client cancel."""

from __future__ import annotations

import json
import queue
import re
import shutil
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from examples import generator as example
from tritonguard.core.repository import write_config
from tritonguard.ops.server import Server

pytestmark = pytest.mark.functional

PROMPT = "Return the"
GREEDY = {"max_tokens": 64, "temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("genrepo")
    t0 = time.perf_counter()
    figures = example.build(repo, "tinylm")
    print(f"tinylm built in {time.perf_counter() - t0:.1f}s: {figures}")
    # the same weights with a high cap: a generation long enough to cancel midway
    shutil.copytree(repo / "tinylm", repo / "tinylong")
    write_config(repo / "tinylong", example.triton_config("tinylong", max_tokens_cap=1_000_000))
    # a copy only the metrics test sends to: its counters start at 0
    shutil.copytree(repo / "tinylm", repo / "tinymetrics")
    write_config(repo / "tinymetrics", example.triton_config("tinymetrics"))
    srv = Server(repository=repo, log_path=tmp_path_factory.mktemp("genlogs") / "tritonserver.log")
    srv.start(wait_models=("tinylm", "tinylong", "tinymetrics"))
    yield srv
    srv.stop()


def post(srv, path: str, body: dict, timeout: float = 30) -> tuple[int, bytes]:
    req = urllib.request.Request(f"http://{srv.http_url}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def generate(srv, prompt: str = PROMPT, params: dict | None = None, model: str = "tinylm", **inputs) -> dict:
    body = {"text_input": prompt, "sampling_parameters": json.dumps(params or GREEDY), **inputs}
    status, raw = post(srv, f"/v2/models/{model}/generate", body)
    assert status == 200, raw
    return json.loads(raw)


def sse(raw: bytes) -> list[dict]:
    return [json.loads(line[len(b"data: "):]) for line in raw.splitlines() if line.startswith(b"data: ")]


def grpc_inputs(prompt: bytes, stream: bool, params: dict) -> list:
    out = []
    for name, arr, dtype in (("text_input", np.array([prompt], dtype=object), "BYTES"),
                             ("stream", np.array([stream]), "BOOL"),
                             ("sampling_parameters", np.array([json.dumps(params).encode()], dtype=object), "BYTES")):
        t = grpcclient.InferInput(name, [1], dtype)
        t.set_data_from_numpy(arr)
        out.append(t)
    return out


def test_generate_greedy_is_deterministic_and_prefixed(server):
    first = generate(server)
    assert first["model_name"] == "tinylm"
    text = first["text_output"]
    assert text.startswith(PROMPT) and len(text) > len(PROMPT)
    assert generate(server)["text_output"] == text
    assert generate(server, exclude_input_in_output=True)["text_output"] == text[len(PROMPT):]


def test_generate_stream_pieces_add_up_to_the_greedy_text(server):
    whole = generate(server, exclude_input_in_output=True)["text_output"]
    t0 = time.perf_counter()
    status, raw = post(server, "/v2/models/tinylm/generate_stream",
                       {"text_input": PROMPT, "stream": True, "sampling_parameters": json.dumps(GREEDY)})
    dt = time.perf_counter() - t0
    events = sse(raw)
    assert status == 200 and events
    assert all("error" not in e for e in events), events
    pieces = [e["text_output"] for e in events]
    assert "".join(pieces) == whole
    assert all(len(p) == 1 for p in pieces)  # one response per token (character)
    print(f"SSE: {len(pieces)} responses in {dt * 1000:.0f} ms")


def test_seeded_sampling_over_http(server):
    params = {"max_tokens": 64, "temperature": 0.8, "top_p": 0.95, "seed": 42}
    texts = {generate(server, params=params)["text_output"] for _ in range(3)}
    assert len(texts) == 1


def test_a_stop_sequence_ends_the_answer_before_it(server):
    """vLLM's ``stop``: the answer ends before the first stop sequence, which is never sent,
    whole and streamed (the last pieces held back while they may still begin one)."""
    whole = generate(server, exclude_input_in_output=True)["text_output"]
    stop = whole[10:12]
    cut = whole[:whole.find(stop)]
    params = {**GREEDY, "stop": [stop, "never in it"]}
    assert generate(server, params=params, exclude_input_in_output=True)["text_output"] == cut
    assert generate(server, params=params)["text_output"] == PROMPT + cut
    status, raw = post(server, "/v2/models/tinylm/generate_stream",
                       {"text_input": PROMPT, "stream": True, "sampling_parameters": json.dumps(params)})
    events = sse(raw)
    assert status == 200 and all("error" not in e for e in events), events
    assert "".join(e["text_output"] for e in events) == cut


def test_grpc_stream(server):
    whole = generate(server, exclude_input_in_output=True)["text_output"]
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        for stream in (True, False):
            client.async_stream_infer("tinylm", grpc_inputs(PROMPT.encode(), stream, GREEDY),
                                      request_id=f"s{stream}", enable_empty_final_response=True)
            pieces = []
            while True:
                result, error = results.get(timeout=20)
                assert error is None, error
                out = result.as_numpy("text_output")
                if out is not None:
                    pieces.append(out[0].decode())
                if result.get_response().parameters["triton_final_response"].bool_param:
                    break
            if stream:
                assert "".join(pieces) == whole and len(pieces) == len(whole)
            else:
                assert pieces == [PROMPT + whole]
        # invalid UTF-8 in the prompt: a clear error on the stream, which stays usable
        client.async_stream_infer("tinylm", grpc_inputs(b"ab\xff", True, GREEDY), request_id="bad")
        _, error = results.get(timeout=20)
        assert error is not None and "text_input" in str(error) and "UTF-8" in str(error)
    finally:
        client.stop_stream()
        client.close()


@pytest.mark.parametrize(("body", "needle"), [
    ({"text_input": PROMPT, "sampling_parameters": "{max_tokens: 3"}, "'sampling_parameters' violates JSON"),
    ({"text_input": PROMPT, "sampling_parameters": '{"max_tokens": 257}'}, "1..256"),
    ({"text_input": PROMPT, "sampling_parameters": '{"top_k": 5}'}, "unknown key 'top_k'"),
    ({"text_input": PROMPT, "sampling_parameters": '{"stop": ["", "x"]}'}, "violates key 'stop'"),
    ({"text_input": "", "sampling_parameters": "{}"}, "'text_input' violates non-empty"),
])
def test_bad_inputs_get_clear_errors_and_the_server_keeps_serving(server, body, needle):
    status, raw = post(server, "/v2/models/tinylm/generate", body)
    assert status == 400, raw
    assert needle in json.loads(raw)["error"]
    assert generate(server)["text_output"].startswith(PROMPT)


def test_concurrent_requests_match_serial_ones(server):
    params = [{"max_tokens": 128, "temperature": t, "seed": i} for i, t in enumerate([0, 0.7, 1.0, 1.2] * 2)]
    serial = [generate(server, params=p)["text_output"] for p in params]
    with ThreadPoolExecutor(len(params)) as pool:
        concurrent = list(pool.map(lambda p: generate(server, params=p)["text_output"], params))
    assert concurrent == serial


def test_grpc_cancel_stops_decoding(server):
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        client.async_stream_infer("tinylong", grpc_inputs(PROMPT.encode(), True,
                                                          {"max_tokens": 1_000_000, "temperature": 0}))
        for _ in range(20):
            _, error = results.get(timeout=20)
            assert error is None
        client.stop_stream(cancel_requests=True)
    finally:
        client.close()
    deadline = time.monotonic() + 10
    while "request cancelled after" not in server.tail(200) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "request cancelled after" in server.tail(200)
    assert generate(server, model="tinylong")["text_output"].startswith(PROMPT)


SAMPLE = re.compile(r'^(tritonguard_generation_\w+)\{([^}]*)\} (\S+)$')


def generation_metrics(srv, model: str) -> dict[tuple, float]:
    """``{(sample name, label, value, ...): value}`` of the model's tritonguard_generation_* series."""
    text = urllib.request.urlopen(srv.metrics_url, timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        m = SAMPLE.match(line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
            if labels.pop("model", None) == model and labels.pop("version", None) == "1":
                out[(m.group(1), *sorted(labels.items()))] = float(m.group(3))
    return out


def test_generation_metrics_count_what_was_sent(server):
    model = "tinymetrics"
    base = generation_metrics(server, model)
    # counters without events exist at 0 from load
    for outcome in ("ok", "cancelled", "error", "rejected"):
        assert base[("tritonguard_generation_requests_total", ("outcome", outcome))] == 0
    streamed = []
    for n in (1, 5, 23, 64):
        status, raw = post(server, f"/v2/models/{model}/generate_stream",
                           {"text_input": PROMPT, "stream": True,
                            "sampling_parameters": json.dumps({"max_tokens": n, "temperature": 0})})
        assert status == 200, raw
        events = sse(raw)
        assert all("error" not in e for e in events), events
        streamed.append("".join(e["text_output"] for e in events))
    whole = [generate(server, params={"max_tokens": n, "temperature": 0.8, "seed": n}, model=model,
                      exclude_input_in_output=True)["text_output"] for n in (3, 40)]
    prefixed = generate(server, params={"max_tokens": 12, "temperature": 0}, model=model)["text_output"]
    whole.append(prefixed[len(PROMPT):])
    rejected = 0
    for body in ({"text_input": PROMPT, "sampling_parameters": '{"max_tokens": 1000}'},
                 {"text_input": "", "sampling_parameters": "{}"}):
        status, _ = post(server, f"/v2/models/{model}/generate", body)
        assert status == 400
        rejected += 1

    texts = streamed + whole
    sent = len(texts)
    want = {
        ("tritonguard_generation_requests_total", ("outcome", "ok")): sent,
        ("tritonguard_generation_requests_total", ("outcome", "rejected")): rejected,
        ("tritonguard_generation_requests_total", ("outcome", "cancelled")): 0,
        ("tritonguard_generation_requests_total", ("outcome", "error")): 0,
        ("tritonguard_generation_tokens_total", ("direction", "in")): len(PROMPT) * sent,
        # one token per character: tokens out are the characters the clients got
        ("tritonguard_generation_tokens_total", ("direction", "out")): sum(len(t) for t in texts),
        ("tritonguard_generation_ttft_seconds_count",): sum(1 for t in texts if t),
        # one ITL observation (the request's mean) per streamed request with two tokens or more
        ("tritonguard_generation_itl_seconds_count",): sum(1 for t in streamed if len(t) >= 2),
    }
    deadline = time.monotonic() + 10  # the flusher pushes once a second
    while True:
        got = generation_metrics(server, model)
        if all(got.get(k) == v for k, v in want.items()) or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    assert {k: got.get(k) for k in want} == want
    assert want[("tritonguard_generation_itl_seconds_count",)] == 3  # the max_tokens=1 stream has none
    # buckets from 0.1 ms to 10 s; every TTFT here is well under 10 s
    ttft = {dict([k[1]])["le"]: v for k, v in got.items() if k[0] == "tritonguard_generation_ttft_seconds_bucket"}
    assert {"0.0001", "10", "+Inf"} <= set(ttft)
    assert ttft["10"] == ttft["+Inf"] == want[("tritonguard_generation_ttft_seconds_count",)]
    assert 0 < got[("tritonguard_generation_itl_seconds_sum",)] < 3 * 1.0
