"""A decoupled guard in front of decoupled generators on a real tritonserver: tinylm, and a
test-only echo model that streams its prompt back one character per response (so PII is split
over single-character tokens). SSE /generate_stream, gRPC streaming, bad inputs, a target that
fails mid-stream, a token-budget refusal, a client cancel, and output rails that block (a word
rule, the example classifier) and stop the generator."""

from __future__ import annotations

import json
import queue
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient

from examples import generator as example
from examples import rails_classifier
from tests.functional.test_generator import GREEDY, PROMPT, grpc_inputs, post
from tritonguard.core.repository import write_config
from tritonguard.ops.server import Server

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.functional

RAIL_WINDOW = 8  # rails.holdback_tokens of the railed guards
PII = "Call me at (555) 867-5309 or mail john.smith@example.com, thanks."
REDACTED = "Call me at [PHONE] or mail [EMAIL], thanks."

# The vLLM contract, decoupled: streams the prompt back one character per response (at most
# max_tokens); "FAIL!" in the prompt fails the stream after three characters; it pauses 1 s
# after sending a "|".
ECHO_MODEL = '''
import json
import time
import numpy as np
import triton_python_backend_utils as pb_utils


def _get(request, name):
    t = pb_utils.get_input_tensor_by_name(request, name)
    return None if t is None else t.as_numpy().reshape(-1)[0]


class TritonPythonModel:
    def initialize(self, args):
        params = json.loads(args["model_config"]).get("parameters", {})
        # a pause after each word: its characters arrive together, the next word later
        self.word_pause_s = float(params.get("word_pause_s", {}).get("string_value", "0"))

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
            prompt = _get(request, "text_input").decode()
            stream = bool(_get(request, "stream") or False)
            exclude = _get(request, "exclude_input_in_output")
            sp = _get(request, "sampling_parameters")
            max_tokens = json.loads(sp).get("max_tokens", 16) if sp else 16
            print(f"echo saw: {prompt}", flush=True)
            text = prompt[:max_tokens]
            if stream:
                for i, ch in enumerate(text):
                    if "FAIL!" in prompt and i == 3:
                        try:
                            sender.send(pb_utils.InferenceResponse(
                                output_tensors=[], error=pb_utils.TritonError("echo broke mid-stream")), flags=final)
                        except Exception as exc:
                            print(f"echo could not fail: {exc!r}", flush=True)
                        break
                    if request.is_cancelled():
                        print("echo cancelled", flush=True)
                        sender.send(flags=final)
                        break
                    out = pb_utils.Tensor("text_output", np.array([ch.encode()], dtype=object))
                    sender.send(pb_utils.InferenceResponse([out]))
                    if ch == "|":
                        time.sleep(1.0)
                    elif ch == " " and self.word_pause_s:
                        time.sleep(self.word_pause_s)
                else:
                    sender.send(flags=final)
            else:
                whole = text if exclude else prompt + text
                out = pb_utils.Tensor("text_output", np.array([whole.encode()], dtype=object))
                sender.send(pb_utils.InferenceResponse([out]), flags=final)
        return None
'''


def _params(**kw: str) -> dict:
    return {k.replace("__", "."): {"string_value": v} for k, v in kw.items()}


@pytest.fixture(scope="module")
def server(tmp_path_factory, exported_repo):
    repo = tmp_path_factory.mktemp("streamrepo")
    for name in ("minilm_raw", "minilm_tokenizer", "minilm_encoder"):  # the semantic cache's embedder
        (repo / name).symlink_to((exported_repo / name).resolve(), target_is_directory=True)
    example.build(repo, "tinylm", steps=40)
    write_config(repo / "tinylm", example.triton_config("tinylm", max_tokens_cap=5000))
    io = {k: v for k, v in example.triton_config("x").items() if k in ("input", "output", "max_batch_size",
                                                                    "model_transaction_policy")}
    write_config(repo / "echo", {"name": "echo", "backend": "python", **io,
                                 "instance_group": [{"count": 1, "kind": "KIND_CPU"}]})
    (repo / "echo" / "1").mkdir()
    (repo / "echo" / "1" / "model.py").write_text(ECHO_MODEL)
    # the echo pausing 50 ms after each word: behind echo_out, whose pieces the tests count. Unpaced,
    # a loaded guard read a whole clause of characters in one batch and sent it as one piece (5
    # pieces where the test wants >= 6, a full run, 2026-11-29): the count then measured the load
    write_config(repo / "echo_words", {"name": "echo_words", "backend": "python", **io,
                                       "parameters": _params(word_pause_s="0.05"),
                                       "instance_group": [{"count": 1, "kind": "KIND_CPU"}]})
    (repo / "echo_words" / "1").mkdir()
    (repo / "echo_words" / "1" / "model.py").write_text(ECHO_MODEL)

    def guard(name: str, **params: str) -> None:
        write_config(repo / name, {"name": name, "backend": "guard", **io, "parameters": _params(**params),
                                   "instance_group": [{"count": 1, "kind": "KIND_CPU"}]})
        (repo / name / "1").mkdir()

    guard("tinylm_guard", target="tinylm", validation__max_tokens="5000", validation__max_temperature="1.5")
    # tinylm's versions run inside the guard (placement inprocess): no second hop per token
    guard("tinylm_local", target="tinylm", placement="inprocess", validation__max_tokens="5000")
    guard("echo_guard", target="echo", validation__max_tokens="512")  # the echo sees the redacted prompt
    # the echo sees the original prompt: only the way out redacts
    # (every piece at once, stream_interval_ms 0: the tests see the hold-back's own granularity)
    guard("echo_out", target="echo_words", validation__max_tokens="512", redaction__model_sees_redacted="false",
          target_idle_timeout_s="2", stream_interval_ms="0")
    guard("echo_paced", target="echo", validation__max_tokens="512", stream_interval_ms="100")
    guard("echo_budget", target="echo", tokens__per_minute="60", validation__max_tokens="512")
    guard("echo_metrics", target="echo", validation__max_tokens="512")  # only test_metrics sends to it
    guard("echo_cached", target="echo", validation__max_tokens="512", cache__enabled="true")
    guard("echo_semantic", target="echo", validation__max_tokens="512", semantic_cache__enabled="true",
          semantic_cache__threshold="0.9")
    guard("misspelt_stream", target="echo", tokens__per_minut="60")
    # output rails: a word rule on tinylm (whose greedy answer to "x = " is "an" and spaces; the
    # rules judge prompts too), with the optional output finish_reason (a block ends as content_filter) and the
    # example classifier on prompts only; the classifier on the echo's answers (no finish_reason:
    # a block is a Triton error)
    rails_classifier.build(repo)
    write_config(repo / "tinylm_railed", {
        "name": "tinylm_railed", "backend": "guard", **io,
        "output": [*io["output"], {"name": "finish_reason", "data_type": "TYPE_STRING", "dims": [-1]}],
        "parameters": _params(target="tinylm", validation__max_tokens="5000", rails__block_words="an",
                              rails__holdback_tokens=str(RAIL_WINDOW), rails__model="rails_classifier",
                              rails__check_answer="false", stream_interval_ms="0"),
        "instance_group": [{"count": 1, "kind": "KIND_CPU"}]})
    (repo / "tinylm_railed" / "1").mkdir()
    guard("echo_railed", target="echo", validation__max_tokens="512", rails__model="rails_classifier",
          rails__check_prompt="false", rails__holdback_tokens=str(RAIL_WINDOW), stream_interval_ms="0")
    # two versions of the same checkpoint behind a guard whose sampled comparisons embed with minilm
    for v in (1, 2):
        shutil.copytree(repo / "tinylm" / "1", repo / "tinylm_ab" / str(v))
    write_config(repo / "tinylm_ab", example.triton_config("tinylm_ab"))
    guard("tinylm_similar", target="tinylm_ab", similarity__model="minilm_raw", routing__poll_interval_s="0.2")
    logs = tmp_path_factory.mktemp("streamlogs")
    guard("echo_audited", target="echo", validation__max_tokens="512", audit__path=str(logs / "stream_audit.jsonl"))
    srv = Server(repository=repo, log_path=logs / "tritonserver.log")
    srv.start(wait_models=("tinylm", "echo", "echo_words", "tinylm_guard", "tinylm_local", "echo_guard", "echo_out", "echo_paced",
                           "echo_budget",
                           "echo_metrics", "echo_cached", "echo_semantic", "echo_audited",
                           "minilm_raw", "tinylm_ab", "tinylm_similar", "rails_classifier", "tinylm_railed",
                           "echo_railed"))
    srv.logs = logs
    yield srv
    srv.stop()


def generate(srv, model: str, prompt: str = PROMPT, params: dict | None = None, **inputs) -> tuple[int, dict]:
    body = {"text_input": prompt, "sampling_parameters": json.dumps(params or GREEDY), **inputs}
    status, raw = post(srv, f"/v2/models/{model}/generate", body)
    return status, json.loads(raw)


def sse(srv, model: str, prompt: str, params: dict | None = None) -> list[dict]:
    status, raw = post(srv, f"/v2/models/{model}/generate_stream",
                       {"text_input": prompt, "stream": True, "sampling_parameters": json.dumps(params or GREEDY)})
    assert status == 200, raw
    return [json.loads(line[6:]) for line in raw.splitlines() if line.startswith(b"data: ")]


def grpc_stream(client, results, model: str, prompt: str, params: dict) -> tuple[list[str], float]:
    """Pieces of one streamed request, and its time to the first piece (s)."""
    t0 = time.perf_counter()
    client.async_stream_infer(model, grpc_inputs(prompt.encode(), True, params), enable_empty_final_response=True)
    pieces, ttft = [], None
    while True:
        result, error = results.get(timeout=20)
        assert error is None, error
        out = result.as_numpy("text_output")
        if out is not None and out[0]:
            ttft = ttft if ttft is not None else time.perf_counter() - t0
            pieces.append(out[0].decode())
        if result.get_response().parameters["triton_final_response"].bool_param:
            return pieces, ttft


def wait_log(srv, needle: str, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while needle not in srv.tail(400) and time.monotonic() < deadline:
        time.sleep(0.1)
    return needle in srv.tail(400)


@pytest.mark.parametrize("guard", ["tinylm_guard", "tinylm_local"])
def test_guarded_tinylm_answers_what_the_raw_model_answers(server, guard):
    status, raw = generate(server, "tinylm")
    assert status == 200
    status, guarded = generate(server, guard)
    assert status == 200 and guarded["text_output"] == raw["text_output"]
    events = sse(server, guard, PROMPT)
    assert all("error" not in e for e in events), events
    assert PROMPT + "".join(e["text_output"] for e in events) == raw["text_output"]
    seeded = {"max_tokens": 40, "temperature": 0.9, "seed": 11}
    assert generate(server, guard, params=seeded)[1]["text_output"] == generate(server, "tinylm", params=seeded)[1][
        "text_output"]


def test_inprocess_placement_refuses_a_bad_sampling_key_and_serves_on(server):
    status, body = generate(server, "tinylm_local", params={"max_tokens": 5, "top_k": 3})
    assert status == 400 and "top_k" in body["error"], body
    assert generate(server, "tinylm_local")[0] == 200


def test_output_redaction_across_single_character_tokens_over_sse(server):
    events = sse(server, "echo_out", PII, {"max_tokens": 200})
    pieces = [e["text_output"] for e in events]
    assert "".join(pieces) == REDACTED
    assert not any(leak in p for p in pieces for leak in ("@", "867", "5309", "smith"))
    assert wait_log(server, f"echo saw: {PII}")  # the target got the original; the way out redacted
    # the default: the prompt is redacted before the target sees it
    assert "".join(e["text_output"] for e in sse(server, "echo_guard", PII, {"max_tokens": 200})) == REDACTED
    assert wait_log(server, f"echo saw: {REDACTED}")
    # the whole text (stream false) in one response, redacted
    status, body = generate(server, "echo_out", PII, {"max_tokens": 200}, exclude_input_in_output=True)
    assert status == 200 and body["text_output"] == REDACTED


def test_grpc_streaming_redaction(server):
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        tail = " And then some more words, long enough to leave the hold-back window."
        pieces, _ = grpc_stream(client, results, "echo_out", PII + tail, {"max_tokens": 200})
        assert "".join(pieces) == REDACTED + tail and not any("@" in p for p in pieces)
        # released as it goes, a word or a few short words behind, not in one piece at the end
        assert len(pieces) >= 6 and pieces[-1] == "window.", pieces
    finally:
        client.stop_stream()
        client.close()


def test_a_fast_stream_is_sent_in_paced_pieces_and_held_text_goes_out_on_time(server):
    """stream_interval_ms 100: the echo's characters (one per response, no delay) leave in a few
    pieces, not one per word; when the target pauses (1 s after "|"), what was held goes out
    after the interval, not with the target's next token."""
    arrivals: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    prompt = ("The paced guard sends the first word at once and the rest together " * 2).strip()
    try:
        client.start_stream(callback=lambda result, error: arrivals.put((result, error, time.perf_counter())))
        for text in (prompt, "Words before the pause | and these after it, a second later."):
            client.async_stream_infer("echo_paced", grpc_inputs(text.encode(), True, {"max_tokens": 200}),
                                      enable_empty_final_response=True)
            pieces, times = [], []
            while True:
                result, error, at = arrivals.get(timeout=20)
                assert error is None, error
                out = result.as_numpy("text_output")
                if out is not None and out[0]:
                    pieces.append(out[0].decode())
                    times.append(at)
                if result.get_response().parameters["triton_final_response"].bool_param:
                    break
            assert "".join(pieces) == text, pieces
            if text == prompt:
                # 135 characters, one a response; echo_out (no interval, its echo pausing after
                # each word) sends about one piece a word (test above). Paced, the first piece goes
                # at once, each next one at least 100 ms after the one before, and what is held at
                # the end right away: n pieces span >= (n - 2) x 100 ms at the guard, one more
                # allowed for the client's arrival times. How many pieces that is follows the
                # echo's speed: 2 alone (the whole echo within 92 ms); 7 or more in a full run on
                # 2026-12-01, where its characters came slower and a bound of 6 failed
                span = times[-1] - times[0]
                print(f"paced: {len(pieces)} pieces over {span:.3f} s")
                assert 2 <= len(pieces) <= 3 + span / 0.1, (pieces, [round(t - times[0], 3) for t in times])
            else:
                # the output redaction keeps back "|" (the word being written); all before it
                # went out about 100 ms after the first piece, while the echo slept
                before = next(k for k, p in enumerate(pieces) if "pause" in p)
                assert times[-1] - times[before] > 0.5, (pieces, [t - times[0] for t in times])
    finally:
        client.stop_stream()
        client.close()


@pytest.mark.parametrize(("body", "needle"), [
    ({"text_input": PROMPT, "sampling_parameters": "{max_tokens: 3"}, "'sampling_parameters' violates JSON"),
    ({"text_input": PROMPT, "sampling_parameters": '{"max_tokens": 5001}'}, "key 'max_tokens': must be an integer in 1..5000"),
    ({"text_input": PROMPT, "sampling_parameters": '{"top_k": 5}'}, "unknown key 'top_k'"),
    ({"text_input": PROMPT, "sampling_parameters": '{"temperature": 1.6}'}, "validation.max_temperature"),
    ({"text_input": PROMPT, "sampling_parameters": '{"top_p": 0}'}, "key 'top_p'"),
    ({"text_input": "", "sampling_parameters": "{}"}, "'text_input' violates non-empty"),
])
def test_bad_inputs_get_clear_errors_and_the_server_keeps_serving(server, body, needle):
    status, raw = post(server, "/v2/models/tinylm_guard/generate", body)
    assert status == 400, raw
    message = json.loads(raw)["error"]
    assert needle in message and "Traceback" not in message
    assert generate(server, "tinylm_guard")[0] == 200


def test_invalid_utf8_over_grpc(server):
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        client.async_stream_infer("tinylm_guard", grpc_inputs(b"ab\xff", True, GREEDY))
        _, error = results.get(timeout=20)
        assert error is not None and "'text_input' violates UTF-8" in str(error)
        pieces, _ = grpc_stream(client, results, "echo_out", "still serving", {"max_tokens": 50})
        assert "".join(pieces) == "still serving"
    finally:
        client.stop_stream()
        client.close()


def test_a_target_failing_mid_stream_ends_the_stream_cleanly(server):
    """The echo sends three characters, then an error response. Triton 2.51's python_backend does
    not deliver that error to the guard's BLS stream (a client of the echo gets it): the guard's
    idle timeout (2 s here) ends the client's stream with UNAVAILABLE instead of leaving it open
    for good, and the guard keeps serving."""
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        t0 = time.monotonic()
        client.async_stream_infer("echo_out", grpc_inputs(b"FAIL! now", True, {"max_tokens": 50}))
        error = None
        while error is None:
            _, error = results.get(timeout=20)
        took = time.monotonic() - t0
        assert "target 'echo_words'" in str(error) and ("failed" in str(error) or "sent nothing for 2 s" in str(error)), error
        assert took < 10, took
        pieces, _ = grpc_stream(client, results, "echo_out", "still serving", {"max_tokens": 50})
        assert "".join(pieces) == "still serving"
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()


def test_token_budget_refusal_is_unavailable_with_retry_advice(server):
    prompt = "x" * 100  # 100 tokens from the echo: over the 60 tokens/minute budget
    status, _ = generate(server, "echo_budget", prompt, {"max_tokens": 100}, exclude_input_in_output=True)
    assert status == 200
    status, body = generate(server, "echo_budget", prompt, {"max_tokens": 100}, exclude_input_in_output=True)
    # /generate answers 400 for any model error (Triton 2.51's generate endpoint); gRPC keeps the code
    assert status == 400 and "token budget of 60 tokens/minute" in body["error"] and "retry after" in body["error"]
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        client.async_stream_infer("echo_budget", grpc_inputs(prompt.encode(), True, {"max_tokens": 100}))
        _, error = results.get(timeout=20)
        # a streamed gRPC error carries the message only (no status code); the guard sends UNAVAILABLE
        assert error is not None and "retry after" in str(error), error
    finally:
        client.stop_stream()
        client.close()
    status, body = generate(server, "echo_budget", "y", params={"max_tokens": 1}, parameters={"tenant": "other"})
    assert status == 200, body  # another tenant has its own budget


def test_misspelt_parameter_fails_the_load_naming_it(server):
    status, raw = post(server, "/v2/repository/index", {})
    reason = next(m.get("reason", "") for m in json.loads(raw) if m["name"] == "misspelt_stream")
    assert "'tokens.per_minut'" in reason


def test_grpc_cancel_stops_the_guarded_stream(server):
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        client.async_stream_infer("tinylm_guard", grpc_inputs(PROMPT.encode(), True,
                                                              {"max_tokens": 5000, "temperature": 0}))
        for _ in range(20):
            _, error = results.get(timeout=20)
            assert error is None
        client.stop_stream(cancel_requests=True)
    finally:
        client.close()
    assert wait_log(server, "stream guard tinylm_guard: client cancelled after")
    # python_backend >= r25.04 cancels the BLS stream (the generator logs it); on 24.10 the guard
    # tells its generator target to stop (a stop request naming the call), then drops the rest
    cancelled = "stream guard tinylm_guard: client cancelled; target stream cancelled"
    assert wait_log(server, cancelled) or wait_log(server, "stream guard tinylm_guard: client cancelled; target "
                                                           "told to stop")
    if cancelled in server.tail(400):
        assert wait_log(server, "request cancelled after")
    else:
        assert wait_log(server, "stopped by its caller after")
    assert generate(server, "tinylm_guard")[0] == 200


def test_metrics_count_requests_tokens_and_time_to_first_piece(server):
    """Two streamed answers, one non-streamed, one refusal: Triton's /metrics has them by outcome,
    the tokens out are the characters the clients got, and TTFT / ITL have one sample per
    answer that sent text (ITL: the streamed ones)."""
    prompts = ["hello there, general", "a second streamed answer"]
    got = ["".join(e["text_output"] for e in sse(server, "echo_metrics", p, {"max_tokens": 200})) for p in prompts]
    assert got == prompts
    status, body = generate(server, "echo_metrics", "whole", {"max_tokens": 200}, exclude_input_in_output=True)
    assert status == 200 and body["text_output"] == "whole", body
    status, _ = generate(server, "echo_metrics", "", {"max_tokens": 5})
    assert status == 400
    want_out = sum(map(len, prompts)) + len("whole")
    # each figure is flushed every second, and a flush can fall between two requests: wait for all
    # of them, not for the answers' alone (the refusal came a flush later once: CI, 2026-11-29)
    deadline = time.monotonic() + 10
    while True:
        req, tok = _scrape_model(server, "tritonguard_stream_requests_total", "echo_metrics"), _scrape_model(server, "tritonguard_stream_tokens_total", "echo_metrics")
        ttft = _scrape_model(server, "tritonguard_stream_ttft_seconds_count", "echo_metrics")
        itl = _scrape_model(server, "tritonguard_stream_itl_seconds_count", "echo_metrics")
        ok = sum(v for k, v in req.items() if 'outcome="ok"' in k)
        rejected = sum(v for k, v in req.items() if 'outcome="rejected"' in k)
        out = sum(v for k, v in tok.items() if 'direction="out"' in k)
        tok_in = sum(v for k, v in tok.items() if 'direction="in"' in k)
        if (ok, rejected, out, tok_in, sum(ttft.values()), sum(itl.values())) == (3, 1, want_out, want_out, 3, 2) \
                or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert ok == 3 and out == want_out, (req, tok)
    assert rejected == 1, req
    assert tok_in == sum(map(len, prompts)) + len("whole"), tok
    assert sum(ttft.values()) == 3 and sum(itl.values()) == 2, (ttft, itl)


def test_a_deterministic_answer_is_cached_and_replayed_as_a_stream(server):
    """Greedy (or seeded) requests are answered from the cache the second time: the target never
    sees the repeat (the echo logs each prompt it gets), the stream replays the same text, and a
    sampled request without a seed is never cached."""
    prompt, params = "cache me once, call +44 20 7946 0958 then", {"max_tokens": 200, "temperature": 0}
    first = sse(server, "echo_cached", prompt, params)
    assert wait_log(server, f"echo saw: {prompt.replace('+44 20 7946 0958', '[PHONE]')}")
    again = sse(server, "echo_cached", prompt, params)
    text = "".join(e["text_output"] for e in first)
    assert text == "".join(e["text_output"] for e in again) == "cache me once, call [PHONE] then"
    assert len(again) > 3  # replayed as a stream, not one blob
    status, body = generate(server, "echo_cached", prompt, params, exclude_input_in_output=True)
    assert status == 200 and body["text_output"] == text  # another output shape: its own entry
    lookups = _scrape_until(server, "tritonguard_stream_cache_lookups_total", "echo_cached", lambda got: _hits(got) == (1, 2))
    seen = server.tail(2000).count("echo saw: cache me once")
    assert seen == 2, seen  # the stream once, the whole answer once; the repeat came from the cache
    assert _hits(lookups) == (1, 2), lookups  # (hits, misses)
    sampled = {"max_tokens": 200, "temperature": 0.8}
    for _ in range(2):
        sse(server, "echo_cached", "never cached", sampled)
    assert wait_log(server, "echo saw: never cached")
    time.sleep(1.5)
    assert server.tail(2000).count("echo saw: never cached") == 2
    lookups = _scrape_model(server, "tritonguard_stream_cache_lookups_total", "echo_cached")
    assert sum(lookups.values()) == 3, lookups  # no lookup for a sampled request


def test_semantic_cache_answers_a_near_duplicate_of_the_same_tenant(server):
    """semantic_cache on (the real minilm_raw embeds the prompts): a near duplicate of an answered
    prompt gets the stored answer after its own prompt (the echo never sees it), another tenant
    and an unrelated prompt go to the target; the lookups are on /metrics by result."""
    params = {"max_tokens": 12, "temperature": 0}
    status, first = generate(server, "echo_semantic", "Return the list of all open files", params)
    assert status == 200 and first["text_output"] == "Return the list of all open files" + "Return the l", first
    status, near = generate(server, "echo_semantic", "return the list of all open files.", params)
    assert status == 200, near
    # the echo would have answered "return the l": the stored continuation came back instead
    assert near["text_output"] == "return the list of all open files." + "Return the l", near
    status, other = generate(server, "echo_semantic", "return the list of all open files.", params,
                             parameters={"tenant": "other"})
    assert status == 200 and other["text_output"].endswith("return the l"), other  # its own answer
    status, unrelated = generate(server, "echo_semantic", "Compute the checksum of a zip archive", params)
    assert status == 200 and unrelated["text_output"].endswith("Compute the "), unrelated
    # streams have entries of their own (another output shape), replayed as a stream
    # (minilm is uncased: the two prompts embed the same; "Open the file named data" and the same
    # with a full stop score only 0.82, "files" and "files." 0.97)
    first_stream = sse(server, "echo_semantic", "Read the whole configuration file", params)
    assert "".join(e["text_output"] for e in first_stream) == "Read the who"
    replayed = sse(server, "echo_semantic", "read the whole configuration file", params)
    assert "".join(e["text_output"] for e in replayed) == "Read the who"  # the echo would send "read the who"
    lookups = _scrape_until(server, "tritonguard_stream_semantic_cache_lookups_total", "echo_semantic",
                            lambda got: _hits(got) == (2, 4))
    log = server.tail(4000)
    assert log.count("echo saw: return the list of all open files.") == 1  # the other tenant's only
    assert "echo saw: read the whole configuration file" not in log
    assert _hits(lookups) == (2, 4), lookups  # (hits, misses)


def test_every_generation_and_refusal_is_audited_on_a_verifiable_chain(server):
    """audit.path set: one 'generation' record per admitted request (who served it, status,
    tokens out, PII redacted in and out, the prompt only as a digest) and one 'reject' per
    refusal, on a hash chain that verifies; no PII in the file."""
    from tritonguard.privacy.audit.verify import verify

    path = server.logs / "stream_audit.jsonl"
    text = "".join(e["text_output"] for e in sse(server, "echo_audited", PII, {"max_tokens": 200}))
    assert text == REDACTED
    status, _ = generate(server, "echo_audited", "", {"max_tokens": 5})
    assert status == 400
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        recs = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        if sum(r.get("type") in ("generation", "reject") for r in recs) >= 2:
            break
        time.sleep(0.3)
    gens = [r for r in recs if r.get("type") == "generation"]
    rejects = [r for r in recs if r.get("type") == "reject"]
    assert len(gens) == 1 and len(rejects) == 1, recs
    g = gens[0]
    assert g["served_by"] == "echo:1" and g["status"] == "ok" and g["stream"] is True, g
    assert g["tokens_out"] == len(REDACTED) and g["redacted_in"] == 2 and g["fallback"] is False, g
    assert len(g["request"]) == 64 and rejects[0]["input"] == "text_input", rejects
    raw = path.read_text()
    assert "867-5309" not in raw and "john.smith@example.com" not in raw
    assert verify(path).ok


def _scrape_model(srv, family: str, model: str) -> dict[str, float]:
    text = urllib.request.urlopen(srv.metrics_url, timeout=10).read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith(family) and f'model="{model}"' in line}


def _hits(lookups: dict[str, float]) -> tuple[float, float]:
    return (sum(v for k, v in lookups.items() if 'result="hit"' in k),
            sum(v for k, v in lookups.items() if 'result="miss"' in k))


def _scrape_until(srv, family: str, model: str, want, timeout: float = 10.0) -> dict[str, float]:
    """The family's samples once ``want(samples)`` holds, or as they are after ``timeout``: the
    guard's metrics thread flushes every second, later when the machine is loaded."""
    deadline = time.monotonic() + timeout
    while True:
        got = _scrape_model(srv, family, model)
        if want(got) or time.monotonic() > deadline:
            return got
        time.sleep(0.25)



def test_sampled_shadow_comparisons_are_scored_by_minilm(server):
    """similarity.model=minilm_raw: a shadow of sampled requests (the candidate's stream consumed
    off the path) gets a sampled_similarity figure from the real embedding model, in [-1, 1], and
    no embedding failed (each failure would count and fall back to character trigrams)."""
    repo = Path(server.repository)
    r = subprocess.run([sys.executable, "-m", "exporter", "route", "tinylm_similar", "--repository", str(repo),
                        "--primary", "1", "--candidate", "2", "--share", "0", "--shadow", "1.0"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    time.sleep(0.5)  # > routing.poll_interval_s
    params = {"max_tokens": 24, "temperature": 0.9, "top_p": 0.95}
    for k in range(6):
        status, body = generate(server, "tinylm_similar", f"Return the {k} open files", params)
        assert status == 200, body
    def sampled(got: dict[str, float]) -> dict[str, float]:
        return {k: v for k, v in got.items() if 'figure="sampled_similarity"' in k and 'kind="shadow"' in k}

    scores = sampled(_scrape_until(server, "tritonguard_validator_score", "tinylm_similar",
                                   lambda got: bool(sampled(got)), timeout=30))
    assert scores, "no sampled_similarity figure was published"
    assert all(-1.0 <= v <= 1.0 for v in scores.values()), scores
    errors = _scrape_model(server, "tritonguard_stream_similarity_errors_total", "tinylm_similar")
    assert errors and all(v == 0 for v in errors.values()), errors


def _stream_final(client, results, model: str, prompt: str, params: dict) -> tuple[list[str], object, object]:
    """Pieces of one streamed request, its final result (None on an error) and its error."""
    client.async_stream_infer(model, grpc_inputs(prompt.encode(), True, params), enable_empty_final_response=True)
    pieces: list[str] = []
    while True:
        result, error = results.get(timeout=30)
        if error is not None:
            return pieces, None, error
        out = result.as_numpy("text_output")
        if out is not None and out[0]:
            pieces.append(out[0].decode())
        if result.get_response().parameters["triton_final_response"].bool_param:
            return pieces, result, None


def test_output_rails_block_without_leaking_and_stop_the_generator(server):
    """A word rule on tinylm: the answer ends with finish_reason content_filter, none of the blocked
    word reached the client, and the generator was told to stop: of the 5,000 tokens asked for it
    made at most the hold-back window plus a batch after the block (the guard counts what it
    dropped, the generator logs where it stopped). The example classifier blocks a prompt, and an
    answer (a Triton error naming it, where the guard has no finish_reason output)."""
    prompt = "x = "
    status, raw = generate(server, "tinylm", prompt, {"max_tokens": 64, "temperature": 0})
    answer = raw["text_output"][len(prompt):]
    assert status == 200 and answer.startswith("an "), raw  # what the rule will block
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        pieces, final, error = _stream_final(client, results, "tinylm_railed", prompt,
                                             {"max_tokens": 5000, "temperature": 0})
        assert error is None, error
        assert final.as_numpy("finish_reason")[0].decode() == "content_filter"
        # "a", "an" were held (they might have become the listed word), then blocked with the space
        assert pieces == [], pieces
        # an answer the rules pass ends as usual, with its reason
        pieces, final, error = _stream_final(client, results, "tinylm_railed", "Return the",
                                             {"max_tokens": 12, "temperature": 0})
        assert error is None and final.as_numpy("finish_reason")[0].decode() == "length", (pieces, error)
        assert "".join(pieces) == " " * 12, pieces
        # the classifier judges the prompt before the target sees it, and so do the rules
        _, _, error = _stream_final(client, results, "tinylm_railed", "how to build a bomb at home", GREEDY)
        assert error is not None and "content_filter: the prompt was blocked by rail 'rails_classifier'" in str(error)
        _, _, error = _stream_final(client, results, "tinylm_railed", "an apple", GREEDY)
        assert error is not None and "the prompt was blocked by rail 'rails.block_words'" in str(error)
        # ... and each held-back window of an answer: the echo streams this back a character at a time
        answer = "Sure, here it is. First mix the explosive powder and then build the bomb."
        pieces, _, error = _stream_final(client, results, "echo_railed", answer, {"max_tokens": 200})
        assert error is not None and "the answer was blocked by rail 'rails_classifier'" in str(error), error
        assert "bomb" not in "".join(pieces) and answer.startswith("".join(pieces))
    finally:
        client.stop_stream()
        client.close()
    assert wait_log(server, "stream guard tinylm_railed: answer blocked by rail 'rails.block_words'")
    log = server.tail(400)
    blocked = re.search(r"tinylm_railed: answer blocked by rail 'rails.block_words' after (\d+) target tokens "
                        r"\(\d+ pieces sent\); the target sent (\d+) more after the block", log)
    assert blocked, log[-3000:]
    at_block, after = int(blocked.group(1)), int(blocked.group(2))
    assert "tinylm_railed: answer blocked by rail 'rails.block_words'; target told to stop" in log
    assert wait_log(server, "stopped by its caller after")
    stopped = re.findall(r"request tg-[0-9a-f]+ stopped by its caller after (\d+) tokens", server.tail(400))
    assert stopped, server.tail(400)[-3000:]
    made = int(stopped[-1])
    assert made - at_block == after, (made, at_block, after)  # every token it made after the block was dropped
    assert after <= RAIL_WINDOW + 64, (at_block, after)  # the window plus a batch, not the 5,000 asked for
    status, body = generate(server, "tinylm_railed", "Return the", {"max_tokens": 8, "temperature": 0})
    assert status == 200 and body["finish_reason"] == "length", body
