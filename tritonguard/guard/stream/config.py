"""A decoupled guard's parameters, section by section (top level, ``validation``, ``redaction``,
``tenancy``, ``tokens``, ``cache``, ``semantic_cache``, ``routing``, ``breaker``, ``audit``,
``similarity``, ``rails``); unknown keys are refused naming the key."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from tritonguard.core.config import from_params, split_parameters
from tritonguard.core.errors import ConfigError
from tritonguard.guard.routing.config import RoutingConfig
from tritonguard.guard.stages.validate import StreamValidationConfig
from tritonguard.guard.stream.openai_target import check_url
from tritonguard.guard.stream.rails import RailsConfig
from tritonguard.privacy.audit.log import AuditConfig
from tritonguard.privacy.cache.config import CacheConfig
from tritonguard.privacy.cache.semantic import SemanticCacheConfig
from tritonguard.privacy.redaction import RedactionConfig
from tritonguard.privacy.tenancy.budget import TokenBudgetConfig
from tritonguard.privacy.tenancy.config import TenancyConfig
from tritonguard.rollout.breaker import BreakerConfig

SECTIONS = ("", "validation", "redaction", "tenancy", "tokens", "cache", "semantic_cache", "routing", "breaker",
            "audit", "similarity", "rails")
# Long enough for every built-in at its usual length: an IPv6 with an embedded IPv4 (45), an
# IBAN with spaces (42), an international phone number (<= 40), and e-mails up to 64 characters.
DEFAULT_HOLDBACK = 64


@dataclass(kw_only=True)
class StreamGuardConfig:
    """Top-level ``parameters`` of a decoupled guard."""

    target: str = ""
    target_version: int = -1
    # bls: the target is called through Triton (a decoupled model with the vLLM backend's
    # contract: text_input, sampling_parameters as JSON; TensorRT-LLM's ensemble is not one);
    # inprocess: a `generator`-backend target's versions run in this process (no second hop per
    # token; tritonguard.generation.local); openai: an OpenAI-compatible server at `target_url`
    # (vLLM, TGI, ...; tritonguard.guard.stream.openai_target), implied by `target_url`
    placement: str = "bls"
    # placement openai: the server's base URL (http(s)://host:port/v1), the model name it serves
    # ("": `target`), and where its API key is read (an environment variable's name or a file;
    # the key itself never goes in config.pbtxt)
    target_url: str = ""  # placement openai: the server's base URL, http(s)://host:port/v1
    target_model: str = ""  # placement openai: the model name the server serves ("": `target`)
    target_api_key_env: str = ""  # placement openai: the environment variable holding its API key
    target_api_key_file: str = ""  # placement openai: a file holding its API key (not both)
    max_in_flight: int = 32  # generations in flight in this instance (worker threads)
    cancel_poll_ms: int = 50
    # the longest wait for the target's next response; past it the client gets UNAVAILABLE (a
    # target that died or failed mid-stream: python_backend 24.10 does not always deliver a
    # decoupled target's error response to a BLS caller, and its iterator has no timeout)
    target_idle_timeout_s: float = 30.0
    # a streamed answer goes out at most one piece per interval (the first at once): what arrives
    # in between is sent together. Each response costs the server and the client about as much
    # as a token; a target slower than this is forwarded token by token as before. 0: every
    # piece at once
    stream_interval_ms: float = 10.0
    # a generation the guard stops reading (a rail's block, a client's cancel, max_tokens) is also
    # stopped at a ``generator``-backend target (python_backend 24.10 has no
    # ResponseIterator.cancel()): a stop file naming the BLS call in the server's stop directory,
    # which the generator lists every 5 ms, else a stop request naming it; false: its rest is
    # only read and dropped
    stop_requests: bool = True

    def __post_init__(self) -> None:
        if not self.target:
            raise ValueError("parameter 'target' (the generator model's name) is required")
        if self.max_in_flight < 1:
            raise ValueError(f"parameter 'max_in_flight' must be >= 1, got {self.max_in_flight}")
        if self.cancel_poll_ms < 0:
            raise ValueError(f"parameter 'cancel_poll_ms' must be >= 0, got {self.cancel_poll_ms}")
        if self.target_url and self.placement == "bls":
            self.placement = "openai"
        if self.placement not in ("bls", "inprocess", "openai"):
            raise ValueError(f"parameter 'placement' must be bls, inprocess or openai, got {self.placement!r}")
        if self.placement == "openai":
            if not self.target_url:
                raise ValueError("parameter 'target_url' is required with placement 'openai'")
            self.target_url = check_url(self.target_url)
        elif self.target_url:
            raise ValueError(f"parameter 'target_url' needs placement 'openai', not {self.placement!r}")
        if self.target_api_key_env and self.target_api_key_file:
            raise ValueError("parameters 'target_api_key_env' and 'target_api_key_file' exclude each other")
        if not (0 <= self.stream_interval_ms <= 1000):
            raise ValueError(f"parameter 'stream_interval_ms' must lie in 0..1000, got {self.stream_interval_ms}")
        if not self.target_idle_timeout_s > 0:
            raise ValueError(f"parameter 'target_idle_timeout_s' must be > 0, got {self.target_idle_timeout_s}")


@dataclass(kw_only=True)
class SimilarityConfig:
    """``similarity.*``: how two sampled texts of a canary/shadow comparison are compared (the
    ``sampled_similarity`` figure)."""

    model: str = ""  # an embedding model called through BLS (e.g. minilm_raw); "": character-trigram cosine
    input: str = "TEXT"  # its BYTES input [n, 1]
    output: str = "EMBEDDING"  # its FP32 output [n, dim]

    def __post_init__(self) -> None:
        self.model = self.model.strip()
        for name in ("input", "output"):
            if not str(getattr(self, name)).strip():
                raise ValueError(f"parameter 'similarity.{name}' must not be empty")


@dataclass
class StreamGuardSettings:
    guard: StreamGuardConfig
    validation: StreamValidationConfig
    redaction: RedactionConfig
    holdback_chars: int
    tenancy: TenancyConfig
    tokens: TokenBudgetConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    semantic: SemanticCacheConfig = field(default_factory=SemanticCacheConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    audit: AuditConfig = field(default_factory=AuditConfig)
    similarity: SimilarityConfig = field(default_factory=SimilarityConfig)
    rails: RailsConfig = field(default_factory=RailsConfig)


def parse_settings(params: Mapping[str, str], *, model: str = "?") -> StreamGuardSettings:
    """config.pbtxt ``parameters`` -> settings; any unknown key or bad value raises ConfigError
    naming the key."""
    groups = split_parameters(params, SECTIONS, model=model)
    red = dict(groups["redaction"])
    raw_holdback = red.pop("holdback_chars", str(DEFAULT_HOLDBACK))
    try:
        holdback = int(raw_holdback.strip())
    except ValueError:
        raise ConfigError(f"model '{model}': parameter 'redaction.holdback_chars': expected an integer, "
                          f"got {raw_holdback!r}") from None
    if not 0 <= holdback <= 4096:
        raise ConfigError(f"model '{model}': parameter 'redaction.holdback_chars' must lie in 0..4096, got {holdback}")
    red.setdefault("redact_outputs", "true")  # the point of a stream guard; may be turned off
    return StreamGuardSettings(
        guard=from_params(StreamGuardConfig, groups[""], model=model),
        validation=from_params(StreamValidationConfig, groups["validation"], section="validation", model=model),
        redaction=from_params(RedactionConfig, red, section="redaction", model=model),
        holdback_chars=holdback,
        tenancy=from_params(TenancyConfig, groups["tenancy"], section="tenancy", model=model),
        tokens=from_params(TokenBudgetConfig, groups["tokens"], section="tokens", model=model),
        cache=from_params(CacheConfig, groups["cache"], section="cache", model=model),
        semantic=from_params(SemanticCacheConfig, groups["semantic_cache"], section="semantic_cache", model=model),
        routing=from_params(RoutingConfig, groups["routing"], section="routing", model=model),
        breaker=from_params(BreakerConfig, groups["breaker"], section="breaker", model=model),
        audit=from_params(AuditConfig, groups["audit"], section="audit", model=model),
        similarity=from_params(SimilarityConfig, groups["similarity"], section="similarity", model=model),
        rails=from_params(RailsConfig, groups["rails"], section="rails", model=model),
    )


