"""The guard's messages (the exact strings its stages write) mapped onto OpenAI errors."""

from __future__ import annotations

import pytest

from tritonguard.core.errors import InvalidInput
from tritonguard.guard.stages.route import NoVersion
from tritonguard.llm.errors import OpenAIError, from_guard
from tritonguard.privacy.tenancy.budget import TokenBudget, TokenBudgetConfig


def test_a_guard_refusal_names_the_openai_field():
    err = from_guard(str(InvalidInput("sampling_parameters", "key 'max_tokens'", "must be an integer in 1..256")))
    assert (err.status, err.param, err.type) == (400, "max_tokens", "invalid_request_error")
    err = from_guard(str(InvalidInput("sampling_parameters", "known keys", "unknown key 'top_k' (supported: ...)")))
    assert err.param == "top_k"
    assert from_guard(str(InvalidInput("text_input", "non-empty", "the prompt is empty"))).param == "prompt"
    assert from_guard(str(InvalidInput("text_input", "non-empty", "the prompt is empty")), chat=True).param == "messages"


def test_a_used_token_budget_is_429_with_retry_after():
    clock = [0.0]
    budget = TokenBudget(TokenBudgetConfig(per_minute=60), clock=lambda: clock[0])
    assert budget.admit("acme") is None
    budget.charge("acme", 90)  # 30 below zero: 31 tokens to refill at 1/s
    err = from_guard(budget.admit("acme"))
    assert (err.status, err.code, err.type) == (429, "rate_limit_exceeded", "tokens")
    assert err.headers() == {"Retry-After": "31", "retry-after-ms": "31000"}


def test_authentication_is_401_and_no_version_is_503():
    assert from_guard("authentication failed: unknown API key in header 'x-tritonguard-api-key'").status == 401
    err = from_guard(str(NoVersion("tinylm")))
    assert (err.status, err.type) == (503, "server_error") and "Retry-After" in err.headers()
    # the guard's own max_in_flight: overloaded (503), not the tenant's limit (429)
    full = from_guard("model 'g' has 32 generations in flight (max_in_flight); retry after 200 ms")
    assert (full.status, full.headers()["Retry-After"]) == (503, "1")
    assert from_guard("Request for unknown model: 'x' is not found").status == 404
    assert from_guard("something odd").status == 500


@pytest.mark.parametrize("status", [400, 401, 429, 503])
def test_the_body_is_an_openai_error_object(status):
    body = OpenAIError(status, "m", "t", "p", "c").body()
    assert body == {"error": {"message": "m", "type": "t", "param": "p", "code": "c"}}
