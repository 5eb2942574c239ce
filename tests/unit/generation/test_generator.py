"""The generator's pieces without Triton: tokenizer, sampling parameters, decoding, the engine."""

from __future__ import annotations

import json
import os
import threading
import time

import numpy as np
import pytest

from examples import generator as example
from tritonguard.core.catalogue import GENERATION_BUCKETS
from tritonguard.core.catalogue import GENERATION_COUNTERS as COUNTERS
from tritonguard.core.catalogue import GENERATION_HISTOGRAMS as HISTOGRAMS
from tritonguard.core.config import from_params
from tritonguard.core.errors import ConfigError, InvalidInput
from tritonguard.generation.contract import SamplingParams, parse_sampling
from tritonguard.generation.decoder import CharTokenizer, Decoder, Sequence, StepModel, pick
from tritonguard.generation.engine import Engine, generation_metrics
from tritonguard.generation.generator import GeneratorConfig, parse_request
from tritonguard.triton import backend as triton
from tritonguard.triton import metrics as metrics_mod

CAP = 256


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A quickly trained tinylm (10 steps: the text is poor, the mechanics are the same)."""
    repo = tmp_path_factory.mktemp("gen")
    figures = example.build(repo, "tinylm", steps=10)
    return repo / "tinylm", figures


@pytest.fixture(scope="module")
def decoder(built):
    folder, _ = built
    tok = CharTokenizer.from_dict(json.loads((folder / "1" / "vocab.json").read_text()))
    return Decoder(StepModel(folder / "1" / "model.onnx"), tok)


# -- tokenizer -----------------------------------------------------------------------------------
def test_tokenizer_round_trip():
    tok = CharTokenizer()
    text = "Return a list of the words.\n\tdef f(x): return {'a': x[0] ~ 1}  # 100%"
    ids = tok.encode(text)
    assert len(ids) == len(text) and tok.eos not in ids and tok.unk not in ids
    assert tok.decode(ids) == text
    assert "".join(tok.piece(i) for i in ids) == text


def test_tokenizer_unknown_chars_and_serialisation():
    tok = CharTokenizer()
    assert tok.encode("é€") == [tok.unk, tok.unk]
    assert tok.decode([tok.eos, *tok.encode("ab"), tok.unk]) == "ab"
    again = CharTokenizer.from_dict(json.loads(json.dumps(tok.to_dict())))
    assert again.itos == tok.itos
    with pytest.raises(ValueError, match="vocab.json"):
        CharTokenizer.from_dict({"kind": "bpe"})


# -- sampling parameters -------------------------------------------------------------------------
def test_sampling_defaults_follow_vllm():
    assert parse_sampling(None, max_tokens_cap=CAP) == SamplingParams(16, 1.0, 1.0, None)
    assert parse_sampling(b"", max_tokens_cap=CAP) == SamplingParams()
    assert parse_sampling("{}", max_tokens_cap=8) == SamplingParams(max_tokens=8)


def test_sampling_accepts_numbers_and_numeric_strings():
    p = parse_sampling('{"max_tokens": "32", "temperature": "0.5", "top_p": 0.9, "seed": 7.0}', max_tokens_cap=CAP)
    assert p == SamplingParams(max_tokens=32, temperature=0.5, top_p=0.9, seed=7)
    assert parse_sampling('{"temperature": 0, "seed": null}', max_tokens_cap=CAP).greedy


def test_sampling_stop_is_a_string_or_a_list_as_vllm_takes_it():
    assert parse_sampling('{"stop": "END"}', max_tokens_cap=CAP).stop == ("END",)
    p = parse_sampling('{"stop": ["a", "bc", "a"], "max_tokens": 4}', max_tokens_cap=CAP)
    assert p.stop == ("a", "bc") and p.given == ("max_tokens", "stop")  # repeats dropped, order kept
    assert parse_sampling('{"stop": []}', max_tokens_cap=CAP) == SamplingParams()
    assert parse_sampling('{"stop": null}', max_tokens_cap=CAP) == SamplingParams()


@pytest.mark.parametrize(("raw", "needle"), [
    ("{max_tokens: 3}", "JSON"),
    ("[1, 2]", "JSON object"),
    ('{"top_k": 3}', "unknown key 'top_k'"),
    ('{"max_tokens": 0}', "'max_tokens'"),
    ('{"max_tokens": 257}', "1..256"),
    ('{"max_tokens": 1.5}', "'max_tokens'"),
    ('{"max_tokens": true}', "'max_tokens'"),
    ('{"max_tokens": "many"}', "'max_tokens'"),
    ('{"temperature": -0.1}', "'temperature'"),
    ('{"temperature": "nan"}', "'temperature'"),
    ('{"temperature": 1e999}', "'temperature'"),
    ('{"top_p": 0}', "'top_p'"),
    ('{"top_p": 1.5}', "(0, 1]"),
    ('{"seed": -1}', "'seed'"),
    ('{"seed": "x"}', "'seed'"),
    ('{"stop": ""}', "'stop'"),
    ('{"stop": ["a", 3]}', "'stop'"),
    ('{"stop": {"a": 1}}', "'stop'"),
    (json.dumps({"stop": [f"s{i}" for i in range(17)]}), "at most 16"),
    (json.dumps({"stop": "x" * 257}), "1..256 characters"),
    (b"\xff{}", "UTF-8"),
])
def test_sampling_rejects_with_key_and_rule(raw, needle):
    with pytest.raises(InvalidInput) as err:
        parse_sampling(raw, max_tokens_cap=CAP)
    assert err.value.input_name == "sampling_parameters"
    assert needle in str(err.value)


def test_pick_greedy_sampling_and_top_p():
    logits = np.array([5.0, 9.0, 1.0, 2.0, 4.5], np.float32)
    rng = np.random.default_rng(0)
    assert pick(logits, SamplingParams(temperature=0), rng, banned=1) == 0  # 1 is banned (UNK)
    # a tiny top_p keeps only the most likely token
    assert {pick(logits, SamplingParams(top_p=1e-6), rng, banned=1) for _ in range(20)} == {0}
    draws = [pick(logits, SamplingParams(temperature=2.0), np.random.default_rng(3), banned=1) for _ in range(3)]
    assert len(set(draws)) == 1
    spread = {pick(logits, SamplingParams(temperature=5.0), rng, banned=1) for _ in range(200)}
    assert 1 not in spread and len(spread) >= 3


# -- requests ------------------------------------------------------------------------------------
def _inputs(prompt=b"Return the", **extra):
    out = {"text_input": np.array([prompt], dtype=object)}
    for name, value in extra.items():
        out[name] = np.array([value], dtype=object if isinstance(value, (bytes, str)) else bool)
    return out


def test_parse_request_defaults_like_vllm():
    cfg = GeneratorConfig()
    seq = parse_request(_inputs(), cfg)
    assert (seq.prompt, seq.stream, seq.prepend_prompt) == ("Return the", False, True)
    seq = parse_request(_inputs(stream=True), cfg)
    assert (seq.stream, seq.prepend_prompt) == (True, False)
    seq = parse_request(_inputs(exclude_input_in_output=True), cfg)
    assert seq.prepend_prompt is False


@pytest.mark.parametrize(("inputs", "name", "needle"), [
    ({}, "text_input", "required"),
    (_inputs(b""), "text_input", "empty"),
    (_inputs(b"ab\xffcd"), "text_input", "UTF-8"),
    (_inputs(b"x" * 9000), "text_input", "max_prompt_chars"),
    ({"text_input": np.array([b"a", b"b"], dtype=object)}, "text_input", "shape [1]"),
    (_inputs(stream=True, exclude_input_in_output=False), "exclude_input_in_output", "stream"),
    (_inputs(sampling_parameters=b'{"max_tokens": 999}'), "sampling_parameters", "max_tokens_cap"),
])
def test_parse_request_rejects(inputs, name, needle):
    with pytest.raises(InvalidInput) as err:
        parse_request(inputs, GeneratorConfig())
    assert err.value.input_name == name and needle in str(err.value)
    assert err.value.code == "INVALID_ARG"


def test_config_parameters_are_checked():
    assert from_params(GeneratorConfig, {"max_tokens_cap": "64"}, model="m").max_tokens_cap == 64
    with pytest.raises(ConfigError, match="max_token_cap"):
        from_params(GeneratorConfig, {"max_token_cap": "64"}, model="m")
    with pytest.raises(ConfigError, match="max_active"):
        from_params(GeneratorConfig, {"max_active": "0"}, model="m")


# -- the built model and decoding ----------------------------------------------------------------
def test_builder_writes_a_small_decoupled_model(built):
    folder, figures = built
    assert sorted(p.name for p in (folder / "1").iterdir()) == ["eval.json", "goldens.json", "manifest.json",
                                                           "model.onnx", "vocab.json"]
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    assert size < 2_000_000
    config = (folder / "config.pbtxt").read_text()
    assert 'backend: "generator"' in config and "decoupled: true" in config
    assert figures["documents"] > 500


def test_greedy_decode_is_deterministic(decoder):
    greedy = SamplingParams(max_tokens=60, temperature=0)
    first = decoder.generate("Return the", greedy)
    assert len(first) == 60 or decoder.generate("Return the", SamplingParams(max_tokens=200, temperature=0)) == first
    assert decoder.generate("Return the", greedy) == first
    assert decoder.generate("Return the", SamplingParams(max_tokens=10, temperature=0)) == first[:10]


def test_seeded_sampling_is_reproducible(decoder):
    params = SamplingParams(max_tokens=80, temperature=0.9, top_p=0.95, seed=11)
    texts = {decoder.generate("Open a file", params) for _ in range(3)}
    assert len(texts) == 1
    others = {decoder.generate("Open a file", SamplingParams(max_tokens=80, temperature=0.9, seed=s)) for s in range(5)}
    assert len(others) > 1


def test_batched_decode_matches_decoding_alone(decoder):
    prompts = ["Return the", "def ", "x" * 40, "The", "Open a file", "é"]
    params = [SamplingParams(max_tokens=50 + 7 * i, temperature=t, seed=i)
              for i, t in enumerate([0, 0.7, 1.0, 0, 1.3, 0.5])]
    alone = [decoder.generate(p, q) for p, q in zip(prompts, params, strict=True)]
    assert decoder.generate_many(prompts, params) == alone


# -- the engine (the decode thread) ---------------------------------------------------------------
class ListSink:
    def __init__(self, cancel_after: int | None = None):
        self.pieces: list[str] = []
        self.final: str | None = None
        self.error: tuple[str, str] | None = None
        self.cancel_after = cancel_after
        self.closed = threading.Event()

    def piece(self, text):
        self.pieces.append(text)

    def finish(self, text):
        self.final = text
        self.closed.set()

    def fail(self, message, code):
        self.error = (message, code)
        self.closed.set()

    def cancelled(self):
        return self.cancel_after is not None and len(self.pieces) >= self.cancel_after


def test_engine_streams_what_it_would_return_whole(decoder):
    engine = Engine(decoder, cancel_poll_s=0)
    try:
        params = SamplingParams(max_tokens=40, temperature=0)
        whole, streamed, prefixed = ListSink(), ListSink(), ListSink()
        engine.submit(Sequence("Return the", params, sink=whole))
        engine.submit(Sequence("Return the", params, stream=True, sink=streamed))
        engine.submit(Sequence("Return the", params, prepend_prompt=True, sink=prefixed))
        for s in (whole, streamed, prefixed):
            assert s.closed.wait(10)
        assert whole.final == decoder.generate("Return the", params)
        assert streamed.final is None and "".join(streamed.pieces) == whole.final
        assert prefixed.final == "Return the" + whole.final
    finally:
        engine.stop()


def test_engine_ends_at_a_stop_sequence_without_sending_it(decoder):
    params = SamplingParams(max_tokens=80, temperature=0)
    full = decoder.generate("Return the", params)
    stop = full[12:14]
    cut = full[:full.find(stop)]
    stopping = SamplingParams(max_tokens=80, temperature=0, stop=(stop, "never appears"))
    assert decoder.generate("Return the", stopping) == cut
    engine = Engine(decoder, cancel_poll_s=0)
    try:
        whole, streamed = ListSink(), ListSink()
        seqs = [Sequence("Return the", stopping, sink=whole), Sequence("Return the", stopping, stream=True, sink=streamed)]
        for seq in seqs:
            engine.submit(seq)
        for sink in (whole, streamed):
            assert sink.closed.wait(10)
        assert whole.final == cut and whole.error is None
        assert streamed.final is None and "".join(streamed.pieces) == cut
        for seq in seqs:  # decoding ended at the stop, not at max_tokens
            assert len(seq.pieces) == full.find(stop) + len(stop) < 80
    finally:
        engine.stop()


def test_engine_cancel_stops_decoding(decoder):
    engine = Engine(decoder, cancel_poll_s=0)
    try:
        sink = ListSink(cancel_after=5)
        engine.submit(Sequence("Return the", SamplingParams(max_tokens=256, temperature=0.5, seed=1),
                               stream=True, sink=sink))
        assert sink.closed.wait(10)
        assert sink.error == ("the request was cancelled", "CANCELLED")
        assert 5 <= len(sink.pieces) <= 6
    finally:
        engine.stop()


class Steady:
    """A decoder whose every step is one "a" after 2 ms, for ever: a generation only a stop ends."""

    def prefill(self, seq):
        seq.logits = np.zeros(4, np.float32)

    def advance(self, seqs):
        time.sleep(0.002)
        return [(s, "a") for s in seqs]


def test_engine_stops_a_generation_named_by_a_stop_file_and_leaves_the_others(tmp_path):
    """The stream guard's stop (contract.write_stop): the decode thread lists the directory every
    cancel poll; a file naming one of its generations ends that one with a plain final response
    and is removed; a file naming another engine's generation stays for that engine (they share
    the server's directory), a stale one is pruned."""
    from tritonguard.generation import engine as engine_mod
    from tritonguard.generation.contract import stop_dir, write_stop

    other = tmp_path / "tg-of-another-engine"
    other.touch()
    stale = tmp_path / "tg-long-gone"
    stale.touch()
    old = time.time() - engine_mod.STOP_TTL_S - 5
    os.utime(stale, (old, old))
    engine = Engine(Steady(), cancel_poll_s=0.01, stop_dir=tmp_path)  # type: ignore[arg-type]
    try:
        stopped, kept = ListSink(), ListSink()
        params = SamplingParams(max_tokens=5000, temperature=0)
        engine.submit(Sequence("x", params, stream=True, sink=stopped, request_id="tg-stop-me"))
        engine.submit(Sequence("x", params, stream=True, sink=kept, request_id="tg-keep-me"))
        while len(stopped.pieces) < 10:
            time.sleep(0.005)
        assert write_stop(tmp_path, "tg-stop-me") and not write_stop(tmp_path, "../escape")
        assert stopped.closed.wait(5) and stopped.final is None and stopped.error is None
        assert len(stopped.pieces) < 5000 and not kept.closed.is_set()
        assert sorted(p.name for p in tmp_path.iterdir()) == ["tg-of-another-engine"]
    finally:
        engine.stop()
    # the server's directory: private to this user, shared by the stubs of one tritonserver
    d = stop_dir()
    try:
        assert d is not None and d.stat().st_mode & 0o777 == 0o700 and str(os.getppid()) in d.name
    finally:
        if d is not None:
            d.rmdir()


def test_a_stop_request_taken_by_another_instance_reaches_the_one_decoding(tmp_path):
    """The generator's own stop request (contract.STOP_PREFIX) lands on any instance of the model
    (each a process; two engines here sharing the server's stop directory): the instance that
    takes it and does not hold the generation leaves a stop file, and the one that decodes it
    stops at its next scan. One that holds it stops at once, no file written."""
    taker = Engine(Steady(), cancel_poll_s=0.01, stop_dir=tmp_path)  # type: ignore[arg-type]
    holder = Engine(Steady(), cancel_poll_s=0.01, stop_dir=tmp_path)  # type: ignore[arg-type]
    try:
        params = SamplingParams(max_tokens=5000, temperature=0)
        far, near = ListSink(), ListSink()
        holder.submit(Sequence("x", params, stream=True, sink=far, request_id="oai-far"))
        taker.submit(Sequence("x", params, stream=True, sink=near, request_id="oai-near"))
        while len(far.pieces) < 10 or len(near.pieces) < 10:
            time.sleep(0.005)
        taker.relay_stop("oai-far")
        assert far.closed.wait(5) and far.final is None and far.error is None
        assert len(far.pieces) < 5000 and not near.closed.is_set()
        assert list(tmp_path.iterdir()) == []  # the holder took its file
        taker.relay_stop("oai-near")
        assert near.closed.wait(5) and near.error is None and len(near.pieces) < 5000
        assert list(tmp_path.iterdir()) == []  # its own: stopped here, no file
    finally:
        taker.stop()
        holder.stop()


def test_engine_queue_full_and_unload():
    class Slow:
        def prefill(self, seq):
            time.sleep(0.3)
            seq.logits = np.zeros(4, np.float32)

        def advance(self, seqs):
            time.sleep(0.05)
            return [(s, "a") for s in seqs]

    engine = Engine(Slow(), max_active=1, max_queue=1)  # type: ignore[arg-type]
    sinks = [ListSink() for _ in range(4)]
    for s in sinks:
        engine.submit(Sequence("p", SamplingParams(max_tokens=256, temperature=0), sink=s))
    assert any(s.error and s.error[1] == "UNAVAILABLE" and "queue" in s.error[0] for s in sinks)
    engine.stop()
    assert all(s.closed.is_set() for s in sinks)
    assert any(s.error == ("the model is unloading", "UNAVAILABLE") for s in sinks)


# -- metrics --------------------------------------------------------------------------------------
class FakeMetrics:
    """The engine's metrics sink: records what the decode thread would hand the flusher."""

    def __init__(self):
        self.counts: dict[tuple, float] = {}
        self.observed: list[tuple[str, float]] = []
        self.lock = threading.Lock()

    def inc(self, family, value=1, **labels):
        with self.lock:
            key = (family, *sorted(labels.items()))
            self.counts[key] = self.counts.get(key, 0) + value

    def observe(self, family, value, **labels):
        assert not labels
        with self.lock:
            self.observed.append((family, value))

    def count(self, family, **labels):
        return self.counts.get((family, *sorted(labels.items())), 0)

    def values(self, family):
        return [v for f, v in self.observed if f == family]


class Paced:
    """A decoder with known timing: prefill 30 ms, then one 'a' every 10 ms."""

    def __init__(self, prefill_s=0.03, step_s=0.01):
        self.prefill_s, self.step_s = prefill_s, step_s

    def prefill(self, seq):
        time.sleep(self.prefill_s)
        seq.logits = np.zeros(4, np.float32)

    def advance(self, seqs):
        time.sleep(self.step_s)
        out = []
        for s in seqs:
            s.pieces.append("a")
            s.done = len(s.pieces) >= s.params.max_tokens
            out.append((s, "a"))
        return out


@pytest.mark.parametrize("per_token", [False, True])
def test_engine_times_first_token_and_inter_token_latency(per_token):
    metrics = FakeMetrics()
    engine = Engine(Paced(), metrics=metrics, itl_per_token=per_token)  # type: ignore[arg-type]
    try:
        streamed, whole = ListSink(), ListSink()
        params = SamplingParams(max_tokens=6, temperature=0)
        engine.submit(Sequence("abcd", params, stream=True, sink=streamed))
        assert streamed.closed.wait(10)
        engine.submit(Sequence("xy", params, sink=whole))
        assert whole.closed.wait(10)
    finally:
        engine.stop()
    assert metrics.count("gen_requests", outcome="ok") == 2
    assert metrics.count("gen_tokens", direction="in") == 4 + 2
    assert metrics.count("gen_tokens", direction="out") == len(streamed.pieces) + len(whole.final) == 12
    ttft = metrics.values("ttft")
    assert len(ttft) == 2 and all(0.035 <= t < 1.0 for t in ttft)  # prefill + one step at least
    itl = metrics.values("itl")
    assert len(itl) == (5 if per_token else 1)  # whole-text requests have no ITL
    assert all(0.008 <= t < 0.5 for t in itl)


def test_engine_counts_every_outcome():
    metrics = FakeMetrics()

    class Failing(Paced):
        def prefill(self, seq):
            if seq.prompt == "boom":
                raise RuntimeError("bad prompt")
            super().prefill(seq)

    engine = Engine(Failing(prefill_s=0.3), max_active=1, max_queue=1, cancel_poll_s=0,  # type: ignore[arg-type]
                    metrics=metrics)
    sinks = [ListSink(cancel_after=3), ListSink(), ListSink()]
    engine.submit(Sequence("p", SamplingParams(max_tokens=256), stream=True, sink=sinks[0]))
    deadline = time.monotonic() + 5
    while not engine.queue.empty() and time.monotonic() < deadline:  # the decode thread took it
        time.sleep(0.005)
    engine.submit(Sequence("boom", SamplingParams(), sink=sinks[1]))
    engine.submit(Sequence("q", SamplingParams(), sink=sinks[2]))  # the queue (1) is full
    for s in sinks:
        assert s.closed.wait(10)
    engine.stop()
    assert sinks[0].error[1] == "CANCELLED" and sinks[1].error[1] == "INTERNAL" and sinks[2].error[1] == "UNAVAILABLE"
    assert {k: v for k, v in metrics.counts.items() if k[0] == "gen_requests"} == {
        ("gen_requests", ("outcome", "cancelled")): 1,
        ("gen_requests", ("outcome", "error")): 1,
        ("gen_requests", ("outcome", "rejected")): 1,
    }
    assert metrics.count("gen_tokens", direction="out") == len(sinks[0].pieces) >= 3
    assert metrics.count("gen_tokens", direction="in") == 1  # only the prefilled prompt
    assert len(metrics.values("ttft")) == 1 and len(metrics.values("itl")) == 1


class FakeMetricFamily:
    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
    registered: list[tuple[str, str]] = []
    children: list[tuple[str, dict, list | None]] = []

    def __init__(self, name, doc, kind):
        self.name = name
        FakeMetricFamily.registered.append((name, kind))

    def Metric(self, labels, buckets=None):  # noqa: N802 - pb_utils' name
        FakeMetricFamily.children.append((self.name, labels, buckets))
        family = self

        class Child:
            def increment(self, v):
                FakeMetricFamily.children.append((family.name, labels, ["inc", v]))

            def observe(self, v):
                FakeMetricFamily.children.append((family.name, labels, ["obs", v]))

            def set(self, v):
                pass

        return Child()


@pytest.fixture()
def fake_pb(monkeypatch):
    FakeMetricFamily.registered, FakeMetricFamily.children = [], []
    monkeypatch.setattr(triton, "pb", lambda: type("pb", (), {"MetricFamily": FakeMetricFamily}))
    return FakeMetricFamily


def test_metrics_takes_the_generator_families(fake_pb):
    m = generation_metrics("tinylm", "1")
    try:
        names = dict(fake_pb.registered)
        assert names == {"tritonguard_metric_drops_total": "counter",
                         **{n: "counter" for n, _ in COUNTERS.values()},
                         **{n: "histogram" for n, _, _ in HISTOGRAMS.values()}}
        zero = {(n, tuple(sorted(lb.items()))) for n, lb, b in fake_pb.children if b is None}
        assert ("tritonguard_generation_requests_total",
                (("model", "tinylm"), ("outcome", "rejected"), ("version", "1"))) in zero
        assert len(zero) == 6  # 4 outcomes + 2 directions
        m.observe("ttft", 0.002)
        m.inc("gen_tokens", 7, direction="out")
        m.flush()
        hist = [(lb, b) for n, lb, b in fake_pb.children if n == "tritonguard_generation_ttft_seconds"]
        assert hist[0] == ({"model": "tinylm", "version": "1"}, list(GENERATION_BUCKETS))
        assert hist[1][1] == ["obs", 0.002]
        assert GENERATION_BUCKETS[0] <= 0.0001 and GENERATION_BUCKETS[-1] >= 5
    finally:
        m.close()


def test_metrics_defaults_are_still_the_guards(fake_pb):
    m = metrics_mod.Metrics("g", "1")
    try:
        names = dict(fake_pb.registered)
        assert set(names) == ({n for n, _ in metrics_mod.Metrics.FAMILIES.values()}
                              | {n for n, _ in metrics_mod.Metrics.GAUGES.values()} | {"tritonguard_target_latency_seconds"})
        assert not any(n.startswith("tritonguard_generation_") for n in names)
        m.observe("latency", 0.01)
        m.flush()
        assert ("tritonguard_target_latency_seconds", {"model": "g", "version": "1"},
                list(metrics_mod.Metrics.LATENCY_BUCKETS)) in fake_pb.children
    finally:
        m.close()
