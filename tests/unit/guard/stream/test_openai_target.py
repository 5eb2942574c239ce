"""A stream guard's target served over the OpenAI protocol by URL
(tritonguard.guard.stream.openai_target), against a real OpenAI-compatible server this project
does not write: ``transformers serve`` on a tiny random GPT-2 built offline, on a loopback port.
The guard's forwarder (rails, pacing, cancel) runs unchanged on its pieces; a cancel or a block
closes the upstream HTTP stream; a server that is not there is UNAVAILABLE; the API key is sent
and never appears in a message or a log line."""

from __future__ import annotations

import http.server
import json
import logging
import threading
import time

import pytest

from tests.unit.guard.stream.recording import Sender
from tests.unit.guard.stream.upstream import free_port, transformers_serve
from tritonguard.core.errors import ConfigError
from tritonguard.generation.contract import SamplingParams
from tritonguard.guard.pipeline import Generation, StreamPipeline
from tritonguard.guard.stream.config import parse_settings
from tritonguard.guard.stream.forwarder import StreamForwarder
from tritonguard.guard.stream.openai_target import OpenAIClient, completion_request, openai_client
from tritonguard.guard.stream.rails import CONTENT_FILTER, Rails, RailsConfig
from tritonguard.guard.stream.target import TargetCalls, TargetFailed

KEY = "sk-test-" + "9f3c1a7e5b2d4c6e8a0f"


@pytest.fixture(scope="module")
def upstream(tmp_path_factory):
    """(base URL, model name) of a real `transformers serve` on a loopback port."""
    with transformers_serve(tmp_path_factory.mktemp("tiny")) as served:
        yield served


class Request:
    """A client that cancels once it got ``after`` pieces (never: None)."""

    def __init__(self, sender: Sender | None = None, after: int | None = None):
        self.sender, self.after = sender, after

    def is_cancelled(self):
        return self.after is not None and len(self.sender.pieces) >= self.after


def forwarder(gen: Generation, client: OpenAIClient, rails: Rails | None = None, ended: list | None = None):
    calls = TargetCalls(name="g", target="t", local=client, idle_s=30)
    fwd = StreamForwarder(gen, calls=calls, pipeline=StreamPipeline([]), name="g", target="t", interval_s=0,
                          cancel_poll_s=0, keep=True, on_end=lambda g, o: (ended if ended is not None else []).append(o),
                          rails=rails)
    return calls, fwd


def sampling(**kw) -> str:
    return json.dumps(kw)


def client_connections(port: int) -> int:
    """ESTABLISHED TCP connections of this machine whose remote end is ``port`` (clients of it)."""
    n = 0
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        cols = line.split()
        if cols[3] == "01" and int(cols[2].split(":")[1], 16) == port:
            n += 1
    return n


# -- against a real OpenAI-compatible server ----------------------------------------------------
def test_a_streamed_answer_comes_through_as_the_server_sends_it(upstream):
    openai = pytest.importorskip("openai")
    url, model = upstream
    with openai.OpenAI(base_url=url, api_key="unused", max_retries=0) as direct:
        chunks = direct.completions.create(model=model, prompt="hello world", max_tokens=12, temperature=0,
                                           stream=True)
        want = "".join(c.choices[0].text for c in chunks if c.choices)
    assert want  # the reference: the official client, streaming, no guard
    client = OpenAIClient(url, model, guard="g", target="t")
    sender = Sender(reasons=True)
    gen = Generation(request=Request(), sender=sender, stream=True, prompt="hello world",
                     params=SamplingParams(max_tokens=12, temperature=0))
    calls, fwd = forwarder(gen, client)
    responses = calls.open(1, gen.prompt, True, sampling(max_tokens=12, temperature=0), None)
    done = fwd.forward(1, responses, time.perf_counter())
    assert done is not None
    text, first, _call_s, tokens = done
    assert text == want and "".join(sender.pieces) + (sender.final[0][1] or "") == want
    # streamed piece by piece, not whole: the server's answer was read as several pieces. (How
    # many pieces the guard then sends depends on timing: it sends what arrived together, and a
    # fast server's 12 tokens were all there at one read in 1 of 6 quiet runs, 2026-11-28; the
    # test counted those.) 12 tokens counted, as the server's usage says (some of the random
    # model's tokens end inside a UTF-8 character and come with the next one)
    assert tokens == 12 and responses.received >= 2 and sender.pieces
    assert sender.final[0][2] == "length" and first is not None
    # a whole-text answer (stream false) gets the prompt in front, as the vLLM backend's does
    whole = calls.run_text(1, "hello world", sampling(max_tokens=12, temperature=0))
    assert whole == want  # run_text excludes the prompt (goldens, canary and shadow runs)
    sender2 = Sender()
    gen2 = Generation(request=Request(), sender=sender2, stream=False, prompt="hello world",
                      params=SamplingParams(max_tokens=12, temperature=0))
    calls2, fwd2 = forwarder(gen2, client)
    assert fwd2.forward(1, calls2.open(1, gen2.prompt, False, sampling(max_tokens=12, temperature=0), None),
                        time.perf_counter()) is not None
    assert sender2.final == [("finish", "hello world" + want, "stop")]


def test_a_cancel_closes_the_upstream_stream(upstream):
    url, model = upstream
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    client = OpenAIClient(url, model, guard="g", target="t")
    sender = Sender()
    gen = Generation(request=Request(sender, after=3), sender=sender, stream=True, prompt="hello world",
                     params=SamplingParams(max_tokens=4000, temperature=0))
    ended: list[str] = []
    calls, fwd = forwarder(gen, client, ended=ended)
    responses = calls.open(1, gen.prompt, True, sampling(max_tokens=4000, temperature=0), None)
    assert fwd.forward(1, responses, time.perf_counter()) is None
    assert ended == ["cancelled"] and sender.final[-1][2] == "CANCELLED"
    assert responses.closed  # the reader ended: the HTTP stream is closed, not drained to 4,000 tokens
    # stopped where the client left: what the server sent after the cancel is a few tokens in
    # flight, not the 4,000 asked for (read and dropped, had the stream been left open)
    assert 3 <= gen.tokens_out <= responses.received <= gen.tokens_out + 64
    for _ in range(50):  # the kernel's view: no connection of ours to the server is left open
        if client_connections(port) == 0:
            break
        time.sleep(0.1)
    assert client_connections(port) == 0


def test_a_rail_block_ends_the_answer_and_closes_the_upstream(upstream):
    url, model = upstream
    client = OpenAIClient(url, model, guard="g", target="t")
    probe = client.open(1, "hello world", True, sampling(max_tokens=6, temperature=0), None)
    word = next(t for b in probe.batches(30, RuntimeError) for r in b if (t := (r.text or "").strip()))
    sender = Sender(reasons=True)
    gen = Generation(request=Request(), sender=sender, stream=True, prompt="hello world",
                     params=SamplingParams(max_tokens=4000, temperature=0))
    ended: list[str] = []
    rails = Rails(RailsConfig(block_words=(word,), holdback_tokens=4), None)
    calls, fwd = forwarder(gen, client, rails=rails, ended=ended)
    responses = calls.open(1, gen.prompt, True, sampling(max_tokens=4000, temperature=0), None)
    assert fwd.forward(1, responses, time.perf_counter()) is None
    assert ended == ["blocked"] and sender.final == [("finish", None, CONTENT_FILTER)]
    assert word not in "".join(sender.pieces)  # the blocked text never reached the client
    assert responses.closed and fwd.blocked_after is not None
    tokens, after = fwd.blocked_after
    assert tokens + after == responses.received <= tokens + 64  # stopped, not drained to 4,000


# -- a server that is not there, or refuses the key ------------------------------------------
def test_an_unreachable_server_is_unavailable():
    port = free_port()  # nothing listens there
    client = OpenAIClient(f"http://127.0.0.1:{port}/v1", "m", guard="g", target="t")
    gen = Generation(request=Request(), sender=Sender(), stream=True, prompt="p",
                     params=SamplingParams(max_tokens=8, temperature=0))
    calls, fwd = forwarder(gen, client)
    with pytest.raises(TargetFailed) as failed:
        fwd.forward(1, calls.open(1, "p", True, sampling(max_tokens=8), None), time.perf_counter())
    assert failed.value.code == "UNAVAILABLE"  # the guard's fallback, then 503 at the front
    assert f"127.0.0.1:{port}/v1 cannot be reached" in failed.value.message
    assert "failed" in failed.value.client_message and "ConnectionRefusedError" in failed.value.message


class KeyEcho(http.server.BaseHTTPRequestHandler):
    """An upstream that refuses every call with 401 and echoes the key it got in its message."""

    seen: list[str] = []

    def do_POST(self):  # noqa: N802 - http.server's name
        auth = self.headers.get("Authorization", "")
        KeyEcho.seen.append(auth)
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        body = json.dumps({"error": {"message": f"invalid key {auth.removeprefix('Bearer ')}",
                                     "type": "invalid_request_error"}}).encode()
        self.send_response(401)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_the_key_is_sent_and_never_in_a_message_or_log(monkeypatch, caplog):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), KeyEcho)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("TG_TEST_UPSTREAM_KEY", KEY)
        settings = parse_settings({"target": "t", "target_url": f"http://127.0.0.1:{server.server_port}/v1",
                                   "target_api_key_env": "TG_TEST_UPSTREAM_KEY"})
        g = settings.guard
        assert g.placement == "openai"
        with caplog.at_level(logging.DEBUG):
            client = openai_client(g.target_url, g.target_model, g.target_api_key_env, g.target_api_key_file,
                                   guard="g", target="t", timeout_s=5)
            gen = Generation(request=Request(), sender=Sender(), stream=True, prompt="p",
                             params=SamplingParams(max_tokens=8, temperature=0))
            calls, fwd = forwarder(gen, client)
            with pytest.raises(TargetFailed) as failed:
                fwd.forward(1, calls.open(1, "p", True, sampling(max_tokens=8), None), time.perf_counter())
        assert KeyEcho.seen == [f"Bearer {KEY}"]  # sent as a bearer token
        assert failed.value.code == "UNAVAILABLE" and "answered 401: invalid key ***" in failed.value.message
        for text in (failed.value.message, failed.value.client_message, caplog.text, repr(vars(client))):
            assert KEY not in text
        assert "API key set" in caplog.text
    finally:
        server.shutdown()
        server.server_close()


# -- parameters ------------------------------------------------------------------------------
def test_target_url_parameters_are_read_and_checked(monkeypatch, tmp_path):
    g = parse_settings({"target": "llm", "target_url": "http://127.0.0.1:8000/v1/"}).guard
    assert (g.placement, g.target_url, g.target_model) == ("openai", "http://127.0.0.1:8000/v1", "")
    assert parse_settings({"target": "llm"}).guard.placement == "bls"
    for params, needle in (
        ({"placement": "openai"}, "'target_url' is required"),
        ({"target_url": "ftp://h/v1"}, r"must be http\(s\)://"),
        ({"target_url": "http://user:Leaked-Pa55@h:1/v1"}, "must not carry credentials"),
        ({"target_url": "http://h:1/v1", "placement": "inprocess"}, "needs placement 'openai'"),
        ({"target_url": "http://h:1/v1", "target_api_key_env": "A", "target_api_key_file": "/k"}, "exclude each other"),
        ({"target_urls": "http://h:1/v1"}, "target_urls"),
    ):
        with pytest.raises(ConfigError, match=needle) as err:
            parse_settings({"target": "llm", **params})
        assert "Leaked-Pa55" not in str(err.value)
    monkeypatch.delenv("TG_TEST_UNSET_KEY", raising=False)
    with pytest.raises(ConfigError, match="'TG_TEST_UNSET_KEY', which is not set"):
        openai_client("http://h:1/v1", "", "TG_TEST_UNSET_KEY", "", guard="g", target="t", timeout_s=1)
    (tmp_path / "key").write_text(KEY + "\n")
    client = openai_client("http://h:1/v1", "", "", str(tmp_path / "key"), guard="g", target="llm", timeout_s=1)
    assert client.model == "llm" and client._headers(b"")["Authorization"] == f"Bearer {KEY}"


def test_the_guards_sampling_keys_become_the_requests_fields():
    body = completion_request("m", "p", json.dumps({"max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "seed": 3}))
    usage = {"stream_options": {"include_usage": True}}
    assert body == {"model": "m", "prompt": "p", "stream": True, **usage, "max_tokens": 7, "temperature": 0.5,
                    "top_p": 0.9, "seed": 3}
    assert completion_request("m", "p", json.dumps({"max_tokens": 4})) == {"model": "m", "prompt": "p",
                                                                          "stream": True, **usage, "max_tokens": 4}
