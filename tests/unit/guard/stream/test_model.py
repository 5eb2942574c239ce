"""The stream guard's parts without a server: hold-back redaction of token streams, the token
budget, parameters and request validation."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from tritonguard.core.errors import ConfigError, InvalidInput
from tritonguard.generation.contract import SamplingParams
from tritonguard.guard.pipeline import Generation
from tritonguard.guard.stages.cache import generation_key, target_fingerprint
from tritonguard.guard.stages.validate import (
    StreamValidationConfig,
    parse_generation,
    target_sampling,
)
from tritonguard.guard.stream.config import DEFAULT_HOLDBACK, parse_settings
from tritonguard.guard.stream.forwarder import replay_pieces
from tritonguard.privacy.redaction import RedactionConfig, Redactor, StreamRedactor
from tritonguard.privacy.tenancy.budget import TokenBudget, TokenBudgetConfig

REDACTOR = Redactor(RedactionConfig())
PII_TEXT = ("Call me at (555) 867-5309 or mail john.smith@example.com, thanks. "
            "From 10.0.0.1, card 4111 1111 1111 1111, +44 20 7946 0958 after hours.")


def stream(text: str, sizes, holdback: int = DEFAULT_HOLDBACK, redactor: Redactor = REDACTOR) -> tuple[list[str], StreamRedactor]:
    s = StreamRedactor(redactor, holdback)
    out, i, k = [], 0, 0
    while i < len(text):
        n = sizes[k % len(sizes)]
        out.append(s.feed(text[i:i + n]))
        i, k = i + n, k + 1
    out.append(s.flush())
    return out, s


def whole(text: str) -> str:
    return REDACTOR.redact_batch([text])[0][0]


@pytest.mark.parametrize("sizes", [[1], [2], [3], [5, 1, 7], [40]])
def test_pii_split_over_pieces_is_redacted_like_the_whole_text(sizes):
    out, s = stream(PII_TEXT, sizes)
    text = "".join(out)
    assert text == whole(PII_TEXT)
    for leaked in ("867-5309", "john.smith", "example.com", "10.0.0.1", "4111", "7946"):
        assert leaked not in text
    assert s.counts == {"PHONE": 2, "EMAIL": 1, "IPV4": 1, "CREDIT_CARD": 1}


def test_no_piece_ever_holds_part_of_a_match():
    # what the client sees piece by piece, not only the joined text
    out, _ = stream("mail bob@corp.io now", [1])
    assert [p for p in out if p] == ["mail ", "[EMAIL]", " now"] or "".join(out) == "mail [EMAIL] now"
    assert not any("@" in p or "bob" in p for p in out)


def test_random_splits_match_redacting_the_whole_text():
    rng = random.Random(0)
    parts = ["x", " ", "555-867-5309", "a.b@c.de", "10.1.2.3", "(212) 555-0182", "word", ",", "\n",
             "4111-1111-1111-1111", "123-45-6789", "1234567", "+1 415 555 2671", "IP ::1"]
    for _ in range(200):
        text = "".join(rng.choice(parts) + rng.choice([" ", ", ", ". ", "\n"]) for _ in range(rng.randint(1, 30)))
        sizes = [rng.randint(1, 6) for _ in range(5)]
        assert "".join(stream(text, sizes, holdback=32)[0]) == whole(text), text


def test_text_without_pii_is_released_a_word_behind():
    """With the built-in recognizers only what may still grow into a match is held back: the
    word being written and the short or digit-bearing words right before it (a phone number, a
    card, an IBAN are groups joined by single spaces), never more than ``holdback``."""
    text = "the string the string the string of the model " * 4
    s, out, worst = StreamRedactor(REDACTOR, 16), "", 0
    for i, ch in enumerate(text, 1):
        out += s.feed(ch)
        assert text.startswith(out)
        worst = max(worst, i - len(out))
    assert worst == len("of the model"), worst  # the short words before the word being written
    assert "".join(stream(text, [3], holdback=16)[0]) == text
    # digits and short groups are held whole, up to the window
    s = StreamRedactor(REDACTOR, 64)
    assert s.feed("calling 4111 1111 ") == "calling "
    assert s.feed("1111 11") == ""
    assert s.feed("11 today ") + s.flush() == "[CREDIT_CARD] today "


def test_random_splits_with_built_ins_match_redacting_the_whole_text():
    """The held-back tail covers every built-in: random texts of prose, short words and PII
    (spaced cards and phones, IBANs, IPv6, e-mails), split at random, redact as the whole text."""
    rng = random.Random(7)
    parts = ["the", "model", "is", "a", "at", "of", "string", "GB82 WEST 1234 5698 7654 32", "4111 1111 1111 1111",
             "+44 20 7946 0958", "(212) 555-0182", "fe80::1ff:fe23:4567:890a", "john.doe@example.com",
             "192.168.10.77", "123-45-6789", "AB12 34", "call", "2024", "5"]
    for _ in range(400):
        text = "".join(rng.choice(parts) + rng.choice([" ", " ", ", ", ". ", "\n"]) for _ in range(rng.randint(1, 25)))
        sizes = [rng.randint(1, 5) for _ in range(7)]
        assert "".join(stream(text, sizes, holdback=64)[0]) == whole(text), text


def test_holdback_zero_or_redaction_off_releases_at_once():
    off = Redactor(RedactionConfig(enabled=False))
    s = StreamRedactor(off, 64)
    assert s.feed("call 555-867-5309") == "call 555-867-5309"
    s = StreamRedactor(REDACTOR, 0)
    assert s.feed("abc ") == "abc "


def test_a_match_reaching_the_window_is_held_until_it_is_complete():
    s = StreamRedactor(REDACTOR, 14)
    released = "".join(s.feed(c) for c in "tel 555-867-5309 and")
    assert released == "tel "  # the number is held back whole: it might still grow
    released += "".join(s.feed(c) for c in " more text here") + s.flush()
    assert released == "tel [PHONE] and more text here"


def test_a_match_longer_than_the_window_still_loses_what_was_held():
    s = StreamRedactor(REDACTOR, 8)
    text = "write to averyveryverylongname@example.com today"
    out = "".join(s.feed(c) for c in text) + s.flush()
    # the local part went out before the "@" came (longer than the window); the rest is redacted
    assert out.startswith("write to averyveryverylongname@") and out.endswith("[EMAIL] today")
    assert "example" not in out


# -- token budget --------------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_token_budget_charges_refills_and_advises_retry():
    clock = Clock()
    b = TokenBudget(TokenBudgetConfig(per_minute=60), clock)  # one token a second
    assert b.admit("acme") is None
    b.charge("acme", 70)  # the admitted request finishes: the bucket goes negative
    b.release("acme")
    why = b.admit("acme")
    assert why is not None and "token budget of 60 tokens/minute" in why and "retry after 11000 ms" in why
    assert b.admit("other") is None  # per tenant
    clock.t += 11
    assert b.admit("acme") is None
    assert b.balance("acme") == pytest.approx(1.0)
    clock.t += 1000
    assert b.balance("acme") == 60  # capped at one minute's worth


def test_token_budget_in_flight_cap():
    b = TokenBudget(TokenBudgetConfig(max_in_flight=2))
    assert b.admit("t") is None and b.admit("t") is None
    why = b.admit("t")
    assert why is not None and "2 generations in flight (tokens.max_in_flight 2)" in why and "retry after" in why
    b.release("t")
    assert b.admit("t") is None


def test_unlimited_budget_admits_everything():
    b = TokenBudget(TokenBudgetConfig())
    assert all(b.admit("t") is None for _ in range(1000))


# -- parameters ------------------------------------------------------------------------------------
def test_settings_defaults_and_sections():
    s = parse_settings({"target": "tinylm", "validation.max_tokens": "64", "redaction.holdback_chars": "40",
                        "tokens.per_minute": "600", "tenancy.quotas": json.dumps({"acme": {"rps": 5}})})
    assert s.guard.target == "tinylm" and s.validation.max_tokens == 64 and s.holdback_chars == 40
    assert s.redaction.redact_outputs is True  # on by default in a stream guard
    assert s.tokens.per_minute == 600 and "acme" in s.tenancy.quotas
    assert parse_settings({"target": "t"}).holdback_chars == DEFAULT_HOLDBACK


def test_similarity_is_trigrams_unless_a_model_is_named():
    default = parse_settings({"target": "t"}).similarity
    assert (default.model, default.input, default.output) == ("", "TEXT", "EMBEDDING")
    s = parse_settings({"target": "t", "similarity.model": "minilm_raw", "similarity.output": "VEC"}).similarity
    assert (s.model, s.input, s.output) == ("minilm_raw", "TEXT", "VEC")


@pytest.mark.parametrize(("params", "needle"), [
    ({"target": "t", "validation.max_tokenz": "5"}, "'validation.max_tokenz'"),
    ({"target": "t", "tokens.per_second": "5"}, "'tokens.per_second'"),
    ({"target": "t", "bogus": "1"}, "'bogus'"),
    ({"target": "t", "cache.semantic": "true"}, "'cache.semantic'"),
    ({"target": "t", "similarity.modle": "minilm_raw"}, "'similarity.modle'"),
    ({"target": "t", "similarity.output": " "}, "'similarity.output'"),
    ({"target": "t", "redaction.holdback_chars": "lots"}, "'redaction.holdback_chars'"),
    ({"target": "t", "redaction.holdback_chars": "-1"}, "'redaction.holdback_chars'"),
    ({"target": "t", "redaction.recognizers": "EMAIL,PASSPORT"}, "PASSPORT"),
    ({"target": "t", "validation.sampling_keys": "top_k"}, "validation.sampling_keys"),
    ({"target": "t", "validation.max_tokens": "0"}, "validation.max_tokens"),
    ({}, "'target'"),
])
def test_bad_parameters_fail_the_load_naming_the_key(params, needle):
    with pytest.raises(ConfigError, match=None) as err:
        parse_settings(params, model="g")
    assert needle in str(err.value)


# -- request validation ----------------------------------------------------------------------------
CFG = StreamValidationConfig(max_tokens=64, max_prompt_chars=100, max_temperature=1.5)


def inputs(prompt=b"Return the", stream=None, sampling=None, exclude=None):
    out = {"text_input": np.array([prompt], dtype=object)}
    if stream is not None:
        out["stream"] = np.array([stream])
    if sampling is not None:
        out["sampling_parameters"] = np.array([sampling if isinstance(sampling, bytes) else json.dumps(sampling).encode()],
                                              dtype=object)
    if exclude is not None:
        out["exclude_input_in_output"] = np.array([exclude])
    return out


def test_a_good_request():
    g = parse_generation(inputs(stream=True, sampling={"max_tokens": "32", "temperature": 0, "seed": 7}), CFG)
    assert g.prompt == "Return the" and g.stream and g.params.max_tokens == 32 and g.params.seed == 7
    assert json.loads(target_sampling(g)) == {"max_tokens": 32, "temperature": 0.0, "seed": 7}
    g = parse_generation(inputs(), CFG)
    assert not g.stream and g.exclude is None
    assert json.loads(target_sampling(g)) == {"max_tokens": 16}  # the guard's default, forwarded


@pytest.mark.parametrize(("kw", "needle"), [
    ({"prompt": b""}, "'text_input' violates non-empty"),
    ({"prompt": b"  \n"}, "'text_input' violates non-empty"),
    ({"prompt": b"ab\xff"}, "'text_input' violates UTF-8"),
    ({"prompt": b"x" * 101}, "at most 100 characters (validation.max_prompt_chars)"),
    ({"sampling": b"{max_tokens: 3"}, "'sampling_parameters' violates JSON"),
    ({"sampling": {"max_tokens": 65}}, "key 'max_tokens': must be an integer in 1..64"),
    ({"sampling": {"max_tokens": 10**12}}, "key 'max_tokens'"),
    ({"sampling": {"top_k": 5}}, "unknown key 'top_k'"),
    ({"sampling": {"temperature": 1.6}}, "at most 1.5 (validation.max_temperature)"),
    ({"sampling": {"temperature": -1}}, "key 'temperature'"),
    ({"sampling": {"top_p": 0}}, "key 'top_p': must be a number in (0, 1]"),
    ({"sampling": {"top_p": 1.5}}, "key 'top_p'"),
    ({"sampling": [1]}, "JSON object"),
    ({"stream": True, "exclude": False}, "'exclude_input_in_output' violates false only without stream"),
])
def test_bad_requests_name_the_input_and_the_rule(kw, needle):
    with pytest.raises(InvalidInput) as err:
        parse_generation(inputs(**kw), CFG)
    assert needle in str(err.value)


def test_sampling_keys_can_be_restricted():
    cfg = StreamValidationConfig(sampling_keys=("max_tokens", "temperature"))
    with pytest.raises(InvalidInput, match="key 'seed' is not allowed here"):
        parse_generation(inputs(sampling={"seed": 1}), cfg)
    assert parse_generation(inputs(sampling={"temperature": 0}), cfg).params.greedy


# -- response cache -------------------------------------------------------------------------------
def _gen(prompt="Return the", tenant="a", stream=True, **params) -> Generation:
    return Generation(prompt=prompt, params=SamplingParams(**{"max_tokens": 16, "temperature": 0.0, **params}),
                      stream=stream, exclude=None, tenant=tenant)


def test_only_deterministic_generations_have_a_cache_key():
    fp = "ab" * 32
    greedy, seeded = generation_key("g", fp, _gen()), generation_key("g", fp, _gen(temperature=0.8, seed=7))
    assert greedy is not None and seeded is not None and greedy != seeded
    assert generation_key("g", fp, _gen(temperature=0.8)) is None  # fresh entropy each time: never cached
    # everything that changes the answer, or who may see it, changes the key
    variants = [_gen(tenant="b"), _gen(prompt="Return a"), _gen(max_tokens=17), _gen(stream=False),
                _gen(temperature=0.8, seed=8)]
    keys = {generation_key("g", fp, v) for v in variants} | {generation_key("g2", fp, _gen()), generation_key("g", "cd" * 32, _gen())}
    assert greedy not in keys and len(keys) == 7


def test_replayed_pieces_join_to_the_text():
    text = "Call [PHONE] now,  then   the string\n the end"
    pieces = replay_pieces(text)
    assert "".join(pieces) == text and len(pieces) == 8 and pieces[2] == "now,  " and replay_pieces("") == []


def test_target_fingerprint_changes_with_the_artifact(tmp_path):
    v = tmp_path / "tinylm" / "1"
    v.mkdir(parents=True)
    (v / "model.onnx").write_bytes(b"weights")
    (v / "vocab.json").write_text("{}")
    first = target_fingerprint(v)
    assert first is not None and target_fingerprint(v) == first
    (v / "model.onnx").write_bytes(b"weights, retrained")
    assert target_fingerprint(v) != first
    assert target_fingerprint(tmp_path / "nothing") is None


def test_every_key_the_stream_guard_doc_names_is_a_parameter_it_takes():
    """docs/stream-guard.md names its parameters in backticks: each one loads with a valid value
    (a misspelt or removed key in the doc fails here, as the batch guard's keys do in
    test_export_merge.py)."""
    import re
    from pathlib import Path

    docs = Path(__file__).resolve().parents[4] / "docs"
    doc = "".join((docs / name).read_text() for name in ("stream-guard.md", "generation.md", "llm.md"))
    keys = set(re.findall(r"`((?:validation|redaction|tenancy|tokens|cache|semantic_cache|routing|breaker|audit"
                          r"|similarity|rails)"
                          r"\.[a-z_]+)`", doc))
    values = {"validation.max_prompt_chars": "100", "validation.max_tokens": "64", "validation.max_temperature": "1",
              "redaction.holdback_chars": "32", "redaction.model_sees_redacted": "false",
              "tokens.per_minute": "600", "tokens.max_in_flight": "2", "cache.enabled": "true",
              "semantic_cache.enabled": "true", "semantic_cache.model": "mini", "semantic_cache.threshold": "0.8",
              "semantic_cache.max_entries_per_tenant": "10", "semantic_cache.ttl_s": "60",
              "semantic_cache.max_prompt_chars": "100", "semantic_cache.deterministic_only": "true",
              "routing.canary_compare": "false", "routing.compare_queue": "8", "breaker.max_nan_rate": "0.1",
              "audit.path": "/tmp/stream_audit.jsonl", "similarity.model": "minilm_raw",
              "similarity.input": "TEXT", "breaker.latency_budget_ms": "500", "routing.latency_ratio": "2",
              "validation.sampling_keys": "max_tokens,temperature", "validation.default_max_tokens": "32",
              # docs/llm.md: how the OpenAI front passes a bearer key to the guard's tenancy
              "tenancy.auth": "api_key", "tenancy.key_header": "x-api-key", "tenancy.jwt_header": "authorization",
              "tenancy.keys_file": "/tmp/keys.toml",
              "rails.block_words": "bomb", "rails.holdback_tokens": "8", "rails.model": "rails_classifier",
              "rails.model_input": "TEXT", "rails.model_output": "probabilities", "rails.threshold": "0.7",
              "rails.check_prompt": "false", "rails.check_answer": "false", "rails.context_chars": "64", "rails.fail_open": "true"}
    assert {"redaction.holdback_chars", "tokens.per_minute", "validation.max_tokens",
            "semantic_cache.threshold", "breaker.max_nan_rate", "similarity.model", "rails.holdback_tokens",
            "rails.block_words"} <= keys, keys
    assert keys <= set(values), keys - set(values)
    for key in keys:
        parse_settings({"target": "t", key: values[key]})
    with pytest.raises(ConfigError, match="'tokens.per_minut'"):
        parse_settings({"target": "t", "tokens.per_minut": "1"})



def test_stream_interval_defaults_to_10_ms_and_refuses_a_negative_or_huge_one():
    assert parse_settings({"target": "t"}).guard.stream_interval_ms == 10
    assert parse_settings({"target": "t", "stream_interval_ms": "0"}).guard.stream_interval_ms == 0
    for bad in ("-1", "5000"):
        with pytest.raises(ConfigError, match="stream_interval_ms"):
            parse_settings({"target": "t", "stream_interval_ms": bad})
