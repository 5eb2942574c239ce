"""The decoupled guard's stage list (tritonguard.guard.pipeline.StreamPipeline) over real stages,
without a server: admission in order, release in reverse, answers that stop admission, and the
answer's text through output redaction.

The router is the only stand-in (a fixed pick): the real StreamRouter reads the rollout state
and calls the target over BLS, which needs Triton; it is tested in test_stream_routing.py and
tests/functional/test_stream_guard.py."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tritonguard.core.errors import InvalidInput, QuotaExceeded
from tritonguard.guard.pipeline import Generation, Stage, StreamPipeline
from tritonguard.guard.stages.cache import Fingerprints, StreamCacheStage
from tritonguard.guard.stages.redact import RedactInStage, RedactOutStage
from tritonguard.guard.stages.route import NoVersion, RouteStage
from tritonguard.guard.stages.tenancy import TenancyStage
from tritonguard.guard.stages.validate import StreamValidateStage, StreamValidationConfig
from tritonguard.privacy.cache.config import CacheConfig
from tritonguard.privacy.cache.tiered import TieredCache
from tritonguard.privacy.redaction import RedactionConfig, Redactor
from tritonguard.privacy.tenancy.budget import TokenBudget, TokenBudgetConfig
from tritonguard.privacy.tenancy.config import TenancyConfig


class Metrics:
    def __init__(self):
        self.counts: dict[tuple, float] = {}

    def inc(self, family, value=1, **labels):
        key = (family, *sorted(labels.items()))
        self.counts[key] = self.counts.get(key, 0) + value

    def total(self, family, **labels):
        return sum(v for k, v in self.counts.items()
                   if k[0] == family and all((n, x) in k[1:] for n, x in labels.items()))


class FixedRouter:
    """routing's pick(): the primary v1, or nothing (every breaker open)."""

    target = "tinylm"

    def __init__(self, version=1):
        self.version = version

    def pick(self):
        return self.version, "primary", 0.5


class Ledger(Stage):
    """Records the order in which the pipeline calls it (the audit stage's place: first, always)."""

    always = True

    def __init__(self, name, log):
        self.name, self.log = name, log

    def admit(self, gen):
        self.log.append(("admit", self.name))

    def end(self, gen):
        self.log.append(("end", self.name, gen.outcome))


def inputs(prompt, stream=True, **sampling):
    out = {"text_input": np.array([prompt.encode()], dtype=np.object_), "stream": np.array([stream])}
    if sampling:
        out["sampling_parameters"] = np.array([json.dumps(sampling).encode()], dtype=np.object_)
    return out


@pytest.fixture
def parts(tmp_path):
    (tmp_path / "tinylm" / "1").mkdir(parents=True)
    (tmp_path / "tinylm" / "1" / "model.onnx").write_bytes(b"weights v1")
    metrics, redactor = Metrics(), Redactor(RedactionConfig())
    budget = TokenBudget(TokenBudgetConfig(max_in_flight=1))
    cache = TieredCache(CacheConfig(enabled=True))
    router = FixedRouter()
    log: list = []
    stages = [
        Ledger("audit", log),
        StreamValidateStage(("text_input", "stream", "sampling_parameters"), StreamValidationConfig()),
        TenancyStage(TenancyConfig(), metrics, str, budget=budget),
        RedactInStage(redactor, ["text_input"], True, False, metrics, str),
        RouteStage(router),
        StreamCacheStage(cache, "guard", Fingerprints(tmp_path, "tinylm", "guard"), metrics, str),
        RedactOutStage(redactor, ["text_output"], metrics, str, holdback=64),
    ]
    return StreamPipeline(stages), metrics, budget, router, log


def serve(pipeline, gen, pieces):
    """What the guard does with a target's pieces: through the filters, then the finish."""
    sent = [pipeline.piece(gen, p) for p in pieces]
    sent.append(pipeline.finish(gen, ""))
    gen.text = "".join(sent)
    return gen.text


def test_a_generation_is_admitted_in_order_and_its_answer_redacted_across_pieces(parts):
    pipeline, metrics, budget, _router, log = parts
    assert pipeline.names() == ["audit", "validate", "tenancy", "redact.input", "route", "cache", "redact.output"]
    assert [s.name for s in pipeline.filters] == ["redact.output"]  # only it sees every piece
    gen = Generation(inputs=inputs("Mail jane.roe@example.com about it", temperature=0, max_tokens=8),
                     parameters={"tenant": "acme"})
    pipeline.admit(gen)
    assert gen.admitted == 7 and gen.answer is None
    assert gen.tenant == "acme" and gen.version == 1 and gen.role == "primary"
    assert "jane.roe@example.com" not in gen.prompt and gen.redacted_in == 1
    assert gen.cache_key is not None and gen.keep_text  # a deterministic miss: its answer is kept
    assert budget.admit("acme") is not None  # tokens.max_in_flight 1: the slot is held
    text = serve(pipeline, gen, ["Write to ", "bo", "b.smith@", "exam", "ple.org", " today"])
    assert "bob.smith" not in text and "example.org" not in text and text.endswith(" today")
    assert gen.redacted_out == 1
    gen.tokens_out, gen.outcome = 6, "ok"
    pipeline.end(gen)
    assert log == [("admit", "audit"), ("end", "audit", "ok")]
    assert budget.admit("acme") is None  # given back at the end
    budget.release("acme")
    assert metrics.total("stream_tokens", direction="out", tenant="acme") == 6
    assert metrics.total("stream_redactions", direction="output") == 1


def test_a_cache_hit_answers_and_the_stages_after_it_are_not_admitted(parts):
    pipeline, metrics, _budget, _router, _log = parts
    first = Generation(inputs=inputs("Return the value", temperature=0), parameters={"tenant": "acme"})
    pipeline.admit(first)
    serve(pipeline, first, ["It ", "returns ", "it."])
    first.outcome = "ok"
    pipeline.end(first)
    def admitted(prompt="Return the value", tenant="acme", **sampling):
        gen = Generation(inputs=inputs(prompt, **(sampling or {"temperature": 0})), parameters={"tenant": tenant})
        pipeline.admit(gen)
        gen.outcome = "ok"
        pipeline.end(gen)  # the guard ends each (tokens.max_in_flight is 1 here)
        return gen

    again = admitted()
    assert again.answer == "It returns it." and again.served_by == "cache"
    assert again.admitted == 6  # through the cache; the output redaction was not admitted
    assert admitted(tenant="other").answer is None  # a tenant never gets another's cached answer
    sampled = admitted(temperature=0.9)
    assert sampled.answer is None and sampled.cache_key is None  # not deterministic: never cached
    assert admitted(prompt="Return the value.").answer is None
    assert metrics.total("stream_cache", result="hit") == 1


def test_a_failed_answer_is_not_cached(parts):
    pipeline, _metrics, _budget, _router, _log = parts
    gen = Generation(inputs=inputs("Return the value", temperature=0), parameters={"tenant": "acme"})
    pipeline.admit(gen)
    serve(pipeline, gen, ["half an ans"])
    gen.outcome = "target_error"
    pipeline.end(gen)
    again = Generation(inputs=inputs("Return the value", temperature=0), parameters={"tenant": "acme"})
    pipeline.admit(again)
    assert again.answer is None


def test_a_refusal_releases_what_the_stages_before_it_took_last_first(parts):
    pipeline, _metrics, budget, router, log = parts
    router.version = None  # every breaker open
    gen = Generation(inputs=inputs("hello"), parameters={"tenant": "acme"})
    with pytest.raises(NoVersion) as err:
        pipeline.admit(gen)
    assert err.value.code == "UNAVAILABLE"
    assert gen.admitted == 4  # audit, validate, tenancy, redact.input
    assert budget.admit("acme") is not None  # held until the end runs
    gen.outcome = "target_error"
    pipeline.end(gen)
    assert budget.admit("acme") is None
    assert log[-1] == ("end", "audit", "target_error")


def test_a_request_refused_by_validation_still_reaches_the_always_stages(parts):
    pipeline, _metrics, _budget, _router, log = parts
    gen = Generation(inputs=inputs("   "), parameters={"tenant": "acme"})
    with pytest.raises(InvalidInput, match="text_input"):
        pipeline.admit(gen)
    gen.outcome = "rejected"
    pipeline.end(gen)
    assert log == [("admit", "audit"), ("end", "audit", "rejected")]
    # refused before the stages ran at all (the guard's own in-flight cap): the audit still ends it
    log.clear()
    late = Generation(error=QuotaExceeded("full"), outcome="rejected")
    pipeline.end(late)
    assert log == [("end", "audit", "rejected")]


def test_a_fallback_starts_the_answer_over_without_what_the_failed_call_held_back(parts):
    pipeline, _metrics, _budget, _router, _log = parts
    gen = Generation(inputs=inputs("Call me"), parameters={"tenant": "acme"})
    pipeline.admit(gen)
    assert "555" not in pipeline.piece(gen, "Please dial (555) 867-")  # the number may still grow: held back
    gen.attempt += 1  # the target failed before anything more was sent: the next version answers
    text = serve(pipeline, gen, ["Sure, ", "later."])
    assert text == "Sure, later." and "555" not in text and "867" not in text
    gen.outcome = "ok"
    pipeline.end(gen)


def test_the_tenancy_stage_refuses_over_budget_and_keeps_no_slot(tmp_path):
    metrics = Metrics()
    budget = TokenBudget(TokenBudgetConfig(per_minute=10, max_in_flight=2), clock=lambda: 0.0)
    stage = TenancyStage(TenancyConfig(), metrics, str, budget=budget)
    gen = Generation(parameters={"tenant": "acme"}, prompt="abc")
    stage.admit(gen)
    gen.tokens_out = 40  # far over the minute's 10
    stage.end(gen)
    late = Generation(parameters={"tenant": "acme"})
    with pytest.raises(QuotaExceeded, match="retry after"):
        stage.admit(late)
    assert not late.budget_admitted
    assert budget.admit("other") is None  # other tenants keep their own budget
    with pytest.raises(InvalidInput, match="tenant"):
        stage.admit(Generation(parameters={"tenant": "no spaces allowed"}))
    assert metrics.total("stream_tokens", direction="in", tenant="acme") == 3
