"""The OpenAI-compatible front on a real tritonserver: tinylm behind three stream guards (plain, with
API keys, with a token budget), the front started by ``python -m exporter openai`` on a free
loopback port, called with the official ``openai`` client (chat and completion, streamed and not)
and with curl. Its answers must be the guard's own answers, token for token."""

from __future__ import annotations

import http.client
import json
import re
import subprocess
import sys
import threading
import time
import urllib.request
import warnings
from pathlib import Path

import openai
import pytest

from examples import generator as example
from tests.functional.test_generation_rollout import slowed
from tests.functional.test_generator import post
from tritonguard.core.repository import read_config, write_config
from tritonguard.ops.server import Server, free_port
from tritonguard.privacy.tenancy.auth import new_api_key

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.functional

PROMPT = "Return the"
CHAT_PROMPT = "User: Return the\nAssistant:"  # the plain template of [{"role": "user", ...}]
SLOWEST = 4096  # the slowed generator's extra work per decode step (slowed(): a 4096 x 4096 matmul)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """(tritonserver, the front's base URL, the acme tenant's API key)."""
    repo = tmp_path_factory.mktemp("openairepo")
    example.build(repo, "tinylm", steps=40)
    key, digest = new_api_key()
    keys = repo / "keys.json"
    keys.write_text(json.dumps({"acme": [digest]}))
    common = {"placement": "inprocess", "validation__max_tokens": "256"}
    # the same answers, each decode step ~100x slower (about 1.5 s for 256 tokens in place of
    # 40 ms): an answer long enough to stop while it is being written
    slowed(repo, 1, 1, SLOWEST, name="tinylm", into="tinylm_slow")
    write_config(repo / "tinylm_slow", {**read_config(repo / "tinylm"), "name": "tinylm_slow"})
    write_config(repo / "tinylm_slow_guard", example.stream_guard_config("tinylm_slow_guard", "tinylm_slow", **common))
    (repo / "tinylm_slow_guard" / "1").mkdir()
    for name, params in (("tinylm_guard", {}),
                         ("tinylm_keyed", {"tenancy__auth": "api_key", "tenancy__keys_file": str(keys)}),
                         ("tinylm_budget", {"tokens__per_minute": "30"}),
                         # the 40-step tinylm answers blanks: eight in a row are "blocked" (the
                         # pattern is not judged on the prompt), before the 16-token window releases any
                         ("tinylm_rails", {"rails__pattern__BLANKS": " {8}", "rails__check_prompt": "false"})):
        cfg = example.stream_guard_config(name, "tinylm", **common, **params)
        if name in ("tinylm_budget", "tinylm_rails"):  # the guard names its finish reason (a budget's cut is only known there)
            cfg["output"].append({"name": "finish_reason", "data_type": "TYPE_STRING", "dims": [1]})
        write_config(repo / name, cfg)
        (repo / name / "1").mkdir()
    logs = tmp_path_factory.mktemp("openailogs")
    srv = Server(repository=repo, log_path=logs / "tritonserver.log")
    srv.start(wait_models=("tinylm", "tinylm_guard", "tinylm_keyed", "tinylm_budget", "tinylm_rails",
                           "tinylm_slow", "tinylm_slow_guard"))
    port = free_port()
    front = subprocess.Popen(
        [sys.executable, "-m", "exporter", "openai", "--server", srv.grpc_url, "--port", str(port),
         "--model", "tinylm_guard", "--model", "tinylm_keyed", "--model", "tinylm_budget", "--model", "tinylm_rails",
         "--model", "tinylm_slow_guard"],
        cwd=ROOT, stdout=open(logs / "front.log", "wb"), stderr=subprocess.STDOUT, start_new_session=True)  # noqa: SIM115
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert front.poll() is None, (logs / "front.log").read_text()
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, (logs / "front.log").read_text()
            time.sleep(0.2)
        yield srv, f"{base}/v1", key
    finally:
        front.terminate()
        try:
            front.wait(10)
        except subprocess.TimeoutExpired:
            front.kill()
        stop_noting_a_slow_unload(srv)


def stop_noting_a_slow_unload(srv: Server, slow_s: float = 10.0) -> None:
    """Stop the server. In runs 26-30, then in run 39 of 2026-11-30, this teardown waited for
    Triton's 30 s exit timeout: the front cancelled its gRPC stream at a stop sequence while the
    guard still answered, and Triton 2.51 can keep a model whose cancelled stream was finished
    anyway counted live (docs/stream-guard.md; ``tools/repro_cancel_stall.py`` shows it on a model
    that is not ours). The guard now applies ``stop`` itself and the front never cancels for one:
    0 of 10 runs under load waited, against 2 of 10 before. Should a stop be slow again, a green
    run's logs being deleted, one slower than ``slow_s`` puts the server's account of it in the
    warnings summary: the guards' lines and Triton's model lines from before the shutdown, and
    the whole shutdown with its countdown shortened (the guard logs when its finalize begins and
    ends)."""
    t0 = time.monotonic()
    srv.stop()
    took = time.monotonic() - t0
    if took <= slow_s:
        return
    try:
        lines = srv.log_path.read_text(errors="replace").splitlines()
    except OSError as exc:
        lines = [f"(the log could not be read: {exc})"]
    cut = next((i for i, line in enumerate(lines) if "All models are stopped" in line), len(lines))
    before = [line for line in lines[max(cut - 400, 0):cut] if "tritonguard" in line or "model_lifecycle" in line]
    countdown = [i for i, line in enumerate(lines) if i >= cut and "live models" in line]
    elided = set(countdown[1:-1])  # the first and last second of the countdown are enough
    after = [line for i, line in enumerate(lines) if i >= cut and i not in elided]
    warnings.warn(f"tritonserver took {took:.1f} s to stop (log {srv.log_path}); before the shutdown:\n"
                  + "\n".join(before[-40:]) + "\nthe shutdown:\n" + "\n".join(after[:60]), stacklevel=1)


def client(stack, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=stack[1], api_key=key, max_retries=0, timeout=30)


def guard_text(srv, prompt: str, max_tokens: int, model: str = "tinylm_guard") -> str:
    """The guard's own greedy answer (Triton's /generate, the prompt excluded)."""
    status, raw = post(srv, f"/v2/models/{model}/generate", {
        "text_input": prompt, "exclude_input_in_output": True,
        "sampling_parameters": json.dumps({"max_tokens": max_tokens, "temperature": 0})})
    assert status == 200, raw
    return json.loads(raw)["text_output"]


def test_models_lists_the_guards(stack):
    assert sorted(m.id for m in client(stack).models.list()) == ["tinylm_budget", "tinylm_guard", "tinylm_keyed",
                                                                  "tinylm_rails", "tinylm_slow_guard"]
    with pytest.raises(openai.NotFoundError):
        client(stack).completions.create(model="no_such_model", prompt=PROMPT, max_tokens=4)


def test_completion_streamed_and_not_is_the_guards_answer(stack):
    expected = guard_text(stack[0], PROMPT, 24)
    whole = client(stack).completions.create(model="tinylm_guard", prompt=PROMPT, max_tokens=24, temperature=0)
    assert whole.choices[0].text == expected and len(expected) == 24
    assert whole.choices[0].finish_reason == "length"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens, whole.usage.total_tokens) == (10, 24, 34)
    chunks = list(client(stack).completions.create(model="tinylm_guard", prompt=PROMPT, max_tokens=24,
                                                   temperature=0, stream=True,
                                                   stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    last = [c for c in chunks if c.choices][-1]
    assert last.choices[0].finish_reason == "length" and last.usage.completion_tokens == 24
    assert all(c.choices[0].finish_reason is None for c in chunks[:-2])
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == 34  # include_usage's own chunk


def test_chat_streamed_and_not_uses_the_plain_template(stack):
    expected = guard_text(stack[0], CHAT_PROMPT, 20)
    messages = [{"role": "user", "content": PROMPT}]
    whole = client(stack).chat.completions.create(model="tinylm_guard", messages=messages, max_tokens=20,
                                                  temperature=0)
    msg = whole.choices[0]
    assert (msg.message.role, msg.message.content, msg.finish_reason) == ("assistant", expected, "length")
    assert whole.usage.prompt_tokens == len(CHAT_PROMPT) and whole.usage.completion_tokens == 20
    chunks = list(client(stack).chat.completions.create(model="tinylm_guard", messages=messages, max_tokens=20,
                                                        temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens == 20


def test_a_stop_sequence_cuts_the_answer(stack):
    full = guard_text(stack[0], PROMPT, 40)
    stop = full[12:14]
    cut = full[:full.find(stop)]
    for stream in (False, True):
        out = client(stack).completions.create(model="tinylm_guard", prompt=PROMPT, max_tokens=40, temperature=0,
                                               stop=[stop], stream=stream)
        if stream:
            chunks = list(out)
            text, finish = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
        else:
            text, finish = out.choices[0].text, out.choices[0].finish_reason
        assert (text, finish) == (cut, "stop"), stream


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"temperature": 5}, "temperature"),  # refused by the front
    ({"n": 2}, "n"),  # what the guard's contract cannot do
    ({"max_tokens": 1000}, "max_tokens"),  # refused by the guard (validation.max_tokens 256): mapped
])
def test_a_bad_field_is_a_400_naming_it(stack, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        client(stack).completions.create(model="tinylm_guard", prompt=PROMPT, **kwargs)
    err = info.value.body
    assert info.value.status_code == 400 and err["param"] == param and err["type"] == "invalid_request_error", err


def test_bearer_keys_map_to_the_guards_tenants(stack):
    _srv, _base, key = stack
    for bad in ("unused", None):
        c = client(stack, bad or "x")
        with pytest.raises(openai.AuthenticationError) as info:
            if bad is None:
                c.chat.completions.with_raw_response.create(model="tinylm_keyed", max_tokens=4,
                                                            messages=[{"role": "user", "content": PROMPT}],
                                                            extra_headers={"Authorization": openai.Omit()})
            else:
                c.chat.completions.create(model="tinylm_keyed", max_tokens=4,
                                          messages=[{"role": "user", "content": PROMPT}])
        want = "authentication required" if bad is None else "authentication failed"  # the guard's own check
        assert info.value.status_code == 401 and info.value.body["message"].startswith(want), info.value.body
        assert key not in str(info.value.body)
    ok = client(stack, key).chat.completions.create(model="tinylm_keyed", max_tokens=4, temperature=0,
                                                    messages=[{"role": "user", "content": PROMPT}])
    assert ok.choices[0].message.content == guard_text(stack[0], CHAT_PROMPT, 4)


def test_a_used_token_budget_is_a_429_with_retry_after(stack):
    c = client(stack)
    first = c.completions.create(model="tinylm_budget", prompt=PROMPT, max_tokens=40, temperature=0)
    # 30 tokens a minute: the 40 asked for reserve the minute's 30 and the answer is cut there,
    # which the guard's finish_reason output tells the front (its own count, 30 < 40, cannot)
    assert (first.usage.completion_tokens, first.usage.total_tokens) == (30, 40)
    assert first.choices[0].finish_reason == "length"
    with pytest.raises(openai.RateLimitError) as info:
        c.completions.create(model="tinylm_budget", prompt=PROMPT, max_tokens=4)
    retry = int(info.value.response.headers["retry-after"])
    assert info.value.status_code == 429 and 1 <= retry <= 60, info.value.response.headers
    assert info.value.body["code"] == "rate_limit_exceeded" and "token budget" in info.value.body["message"]


def test_an_answer_a_rail_blocked_ends_with_content_filter(stack):
    """The guard declares finish_reason: its block is a final response, not an error, and the
    front passes its reason on (streamed and not, chat and completion); nothing held back leaks."""
    c = client(stack)
    whole = c.completions.create(model="tinylm_rails", prompt=PROMPT, max_tokens=40, temperature=0)
    assert (whole.choices[0].text, whole.choices[0].finish_reason) == ("", "content_filter")
    chunks = list(c.chat.completions.create(model="tinylm_rails", messages=[{"role": "user", "content": PROMPT}],
                                            max_tokens=40, temperature=0, stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == ""
    assert chunks[-1].choices[0].finish_reason == "content_filter" and chunks[-1].usage.completion_tokens == 0


def stream_tokens(srv, model: str) -> dict[str, float]:
    """The guard's ``tritonguard_stream_tokens_total`` (out) and its cancelled requests."""
    url = srv.metrics_url if "://" in srv.metrics_url else f"http://{srv.metrics_url}"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out = {"tokens_out": 0.0, "cancelled": 0.0}
    for line in text.splitlines():
        if f'model="{model}"' not in line:
            continue
        if line.startswith("tritonguard_stream_tokens_total{") and 'direction="out"' in line:
            out["tokens_out"] += float(line.rsplit(" ", 1)[1])
        elif line.startswith("tritonguard_stream_requests_total{") and 'outcome="cancelled"' in line:
            out["cancelled"] += float(line.rsplit(" ", 1)[1])
    return out


def test_a_client_that_leaves_mid_stream_stops_the_generation_without_a_cancel(stack):
    """The front's HTTP client goes away after the first piece of a 256-token answer (of the
    slowed generator: one the guard is still writing). The front
    does not cancel the guard's gRPC stream (on Triton 2.51 a cancel can hold the next server
    stop for its exit timeout): it sends the guard a stop request, the guard ends the generation
    at its next cancel poll with a plain final response and stops the target, and the front
    reads the stream to its end."""
    srv, base, _key = stack
    start = stream_tokens(srv, "tinylm_slow_guard")
    full = guard_text(srv, PROMPT, 256, "tinylm_slow_guard")
    assert len(full) >= 200, f"the test needs a long answer to stop: {len(full)} tokens"
    log_mark = srv.log_path.stat().st_size
    deadline, before = time.monotonic() + 10, start
    while before["tokens_out"] < start["tokens_out"] + len(full) and time.monotonic() < deadline:
        time.sleep(0.2)  # the guard's metrics are flushed about once a second
        before = stream_tokens(srv, "tinylm_slow_guard")
    host, port = base.split("//", 1)[1].split("/", 1)[0].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    body = {"model": "tinylm_slow_guard", "prompt": PROMPT, "max_tokens": 256, "temperature": 0, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    first = resp.readline()  # the first event of the answer; then the client leaves
    assert first.startswith(b"data: "), first
    conn.sock.shutdown(2)
    conn.close()
    deadline, said = time.monotonic() + 30, []
    while not said and time.monotonic() < deadline:
        time.sleep(0.2)
        with open(srv.log_path, "rb") as f:
            f.seek(log_mark)
            tail = f.read().decode(errors="replace")
        said = re.findall(r"stream guard tinylm_slow_guard: client asked to stop after (\d+) tokens", tail)
    front = srv.log_path.parent / "front.log"
    assert said, (f"the guard never logged the client's stop:\n{tail[-3000:]}\nthe front's log:\n"
                  f"{front.read_text(errors='replace')[-3000:]}")
    assert "client cancelled" not in tail, tail[-3000:]  # its stream was not cancelled
    stopped_at = int(said[0])
    assert stopped_at < len(full), "the answer ran to its end: nothing was stopped"
    deadline, after = time.monotonic() + 10, stream_tokens(srv, "tinylm_slow_guard")
    while after["cancelled"] == before["cancelled"] and time.monotonic() < deadline:  # metrics flush ~1/s
        time.sleep(0.2)
        after = stream_tokens(srv, "tinylm_slow_guard")
    print(f"stopped after {stopped_at} of {len(full)} tokens; metrics {before} -> {after}")
    assert after["cancelled"] == before["cancelled"] + 1
    assert after["tokens_out"] - before["tokens_out"] == stopped_at
    said = front.read_text(errors="replace")
    assert "is cancelled" not in said and "stop request" not in said, said[-3000:]


def test_a_triton_client_stops_its_generation_with_a_stop_request(stack):
    """docs/stream-guard.md, "Stopping a generation without a cancel", as written there: a
    generation sent with an id over gRPC streaming, then a stop request naming it from another
    client. The generation ends early with a plain final response (no error, nothing cancelled)."""
    import numpy as np
    import tritonclient.grpc as grpcclient

    srv = stack[0]
    url = srv.grpc_url

    def text(value: str):
        t = grpcclient.InferInput("text_input", [1], "BYTES")
        t.set_data_from_numpy(np.array([value.encode()], dtype=np.object_))
        return t

    def flag(name: str, value: bool):
        t = grpcclient.InferInput(name, [1], "BOOL")
        t.set_data_from_numpy(np.array([value], dtype=bool))
        return t

    got: list = []
    ended = threading.Event()

    def on_response(result, error):
        got.append((result, error))
        if error is not None or result.get_response().parameters["triton_final_response"].bool_param:
            ended.set()

    generation = grpcclient.InferenceServerClient(url)
    generation.start_stream(callback=on_response)
    sampling = grpcclient.InferInput("sampling_parameters", [1], "BYTES")
    sampling.set_data_from_numpy(np.array([json.dumps({"max_tokens": 256, "temperature": 0}).encode()], dtype=np.object_))
    generation.async_stream_infer("tinylm_slow_guard", [text(PROMPT), flag("stream", True), sampling],
                                  request_id="gen-42", parameters={"triton_enable_empty_final_response": True})
    deadline = time.monotonic() + 30
    while not got and time.monotonic() < deadline:
        time.sleep(0.01)
    assert got, "no first response"
    # the doc's snippet
    asker = grpcclient.InferenceServerClient(url)
    answers: list = []
    asker.start_stream(callback=lambda result, error: answers.append((result, error)))
    asker.async_stream_infer("tinylm_slow_guard", [text("")], request_id="tritonguard-stop:gen-42",
                             parameters={"triton_enable_empty_final_response": True})
    asker.stop_stream()  # returns once its one (final) response is in
    assert ended.wait(30), "the generation did not end after its stop request"
    generation.stop_stream()
    assert len(answers) == 1 and answers[0][1] is None, answers
    assert all(error is None for _r, error in got), [str(e) for _r, e in got if e is not None]
    streamed = "".join(x.decode() for r, _e in got if r.as_numpy("text_output") is not None
                       for x in r.as_numpy("text_output").reshape(-1))
    tokens = len(streamed)  # tinylm: a token per character
    print(f"stopped after {tokens} streamed tokens of 256")
    assert 1 <= tokens < 200, tokens


def test_curl_reads_the_sse_stream(stack):
    body = {"model": "tinylm_guard", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 12,
            "temperature": 0, "stream": True}
    out = subprocess.run(["curl", "-sN", "--max-time", "30", f"{stack[1]}/chat/completions",
                          "-H", "Content-Type: application/json", "-d", json.dumps(body)],
                         capture_output=True, check=True, timeout=40).stdout.decode()
    events = [line[len("data: "):] for line in out.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", out
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == guard_text(stack[0], CHAT_PROMPT, 12)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and chunks[-1]["usage"]["completion_tokens"] == 12
