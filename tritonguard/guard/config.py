"""A guard model's configuration: its ``config.pbtxt`` parameters, section by section.

Its own module so that the stages a guard runs (privacy, routing, ...) can take the whole
configuration without importing the guard (which imports them).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tritonguard.core.config import (
    LayeredParameters,
    from_params,
    layered_parameters,
    settings_line,
    split_parameters,
    with_source,
)
from tritonguard.core.errors import ConfigError
from tritonguard.core.tensors import ModelSignature, TensorSpec
from tritonguard.guard.routing.config import RoutingConfig
from tritonguard.guard.validation import ValidationConfig
from tritonguard.models.engines import EngineConfig
from tritonguard.observe.cost import CostConfig
from tritonguard.observe.tracing import TracingConfig
from tritonguard.privacy.audit.log import AuditConfig
from tritonguard.privacy.cache.config import CacheConfig
from tritonguard.privacy.redaction import RedactionConfig
from tritonguard.privacy.tenancy.config import TenancyConfig
from tritonguard.rollout.breaker import BreakerConfig
from tritonguard.rollout.feedback import FeedbackConfig
from tritonguard.rollout.judging import JudgeConfig
from tritonguard.rollout.validators import ValidatorConfig

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class TargetConfig:
    """Top-level guard parameters."""

    target: str = ""
    target_version: int = -1  # -1: the latest version Triton serves
    placement: str = "bls"  # bls | inprocess
    timeout_ms: int = 0  # BLS timeout; 0 = none
    # BLS only: the model that serves version N, e.g. "minilm_raw_v{version}" (per-version
    # ensembles); empty: version N of ``target`` itself
    target_per_version: str = ""
    # the public name this guard serves under when it is a step of an ensemble (``<name>`` =
    # ``<name>_intake`` -> ``<name>_guard``, see tritonguard.models.intake): its rollout state,
    # metrics, audit and latency log are keyed by that name; empty: the guard's own name
    serves_as: str = ""

    def __post_init__(self) -> None:
        if not self.target:
            raise ValueError("parameter 'target' is required (the model or ensemble this guard fronts)")
        if self.target_per_version and "{version}" not in self.target_per_version:
            raise ValueError("target_per_version must contain '{version}'")
        if self.placement not in ("bls", "inprocess"):
            raise ValueError(f"placement must be 'bls' or 'inprocess', got {self.placement!r}")


SERVED_BY = "SERVED_BY"  # optional BYTES [1] output: "<target>:<version>" that answered


@dataclass(kw_only=True)
class GuardConfig:
    target: TargetConfig
    validation: ValidationConfig
    runtime: EngineConfig
    routing: RoutingConfig
    breaker: BreakerConfig
    validator: ValidatorConfig
    redaction: RedactionConfig
    tenancy: TenancyConfig
    cache: CacheConfig
    audit: AuditConfig
    tracing: TracingConfig
    cost: CostConfig
    feedback: FeedbackConfig
    judge: JudgeConfig  # read by exporter promote; the guard only checks the values

    SECTIONS = ("", "validation", "runtime", "routing", "breaker", "validator", "redaction", "tenancy", "cache", "audit",
                "tracing", "cost", "feedback", "judge")

    @classmethod
    def from_parameters(cls, params: dict[str, str], model: str) -> GuardConfig:
        groups = split_parameters(params, cls.SECTIONS, model=model)
        return cls(
            target=from_params(TargetConfig, groups[""], model=model),
            validation=from_params(ValidationConfig, groups["validation"], section="validation", model=model),
            runtime=from_params(EngineConfig, groups["runtime"], section="runtime", model=model),
            routing=from_params(RoutingConfig, groups["routing"], section="routing", model=model),
            breaker=from_params(BreakerConfig, groups["breaker"], section="breaker", model=model),
            validator=from_params(ValidatorConfig, groups["validator"], section="validator", model=model),
            redaction=from_params(RedactionConfig, groups["redaction"], section="redaction", model=model),
            tenancy=from_params(TenancyConfig, groups["tenancy"], section="tenancy", model=model),
            cache=from_params(CacheConfig, groups["cache"], section="cache", model=model),
            audit=from_params(AuditConfig, groups["audit"], section="audit", model=model),
            tracing=from_params(TracingConfig, groups["tracing"], section="tracing", model=model),
            cost=from_params(CostConfig, groups["cost"], section="cost", model=model),
            feedback=from_params(FeedbackConfig, groups["feedback"], section="feedback", model=model),
            judge=from_params(JudgeConfig, groups["judge"], section="judge", model=model),
        )

    def sections(self) -> dict[str, Any]:
        """Key prefix ("" for top-level keys) -> the dataclass its keys built."""
        return {s: getattr(self, s or "target") for s in self.SECTIONS}


def load_guard_config(model_params: Mapping[str, str], repo: str | os.PathLike[str] | None,
                      environ: Mapping[str, str], model: str) -> tuple[LayeredParameters, GuardConfig]:
    """A guard's parameters as the model load resolves them (defaults < pyproject.toml <
    ``TRITONGUARD_*`` < config.pbtxt) and its config; a bad key's error names the layer it came
    from. Logs one line naming each non-default setting and its source (secrets as ``<set>``)."""
    params = layered_parameters(model_params, repo, environ)
    try:
        config = GuardConfig.from_parameters(params, model)
    except ConfigError as exc:
        raise ConfigError(with_source(str(exc), params)) from None
    log.info("%s", settings_line(model, params, config.sections()))
    return params, config


def check_signature(guard: ModelSignature, target: ModelSignature, target_name: str) -> None:
    """The guard's public contract must be the target's: same names, dtypes, dims, batch cap."""

    def fmt(s: TensorSpec) -> str:
        return f"{s.name}:{s.triton_type}{list(s.dims)}"

    problems = []
    t_in = {s.name: s for s in target.inputs}
    for s in guard.inputs:
        other = t_in.get(s.name)
        if other is None:
            problems.append(f"input {s.name} is not an input of the target")
        elif other.dtype != s.dtype or len(other.dims) != len(s.dims) or any(
            o != -1 and g != o for g, o in zip(s.dims, other.dims, strict=True)
        ):
            problems.append(f"input {fmt(s)} != target's {fmt(other)}")
    t_out = {s.name: s for s in target.outputs}
    for s in guard.outputs:
        if s.name == SERVED_BY:
            continue
        if s.name not in t_out:
            problems.append(f"output {s.name} is not an output of the target")
    if target.max_batch_size and guard.max_batch_size > target.max_batch_size:
        problems.append(f"max_batch_size {guard.max_batch_size} > target's {target.max_batch_size}")
    if problems:
        raise ConfigError(f"guard does not match target '{target_name}': " + "; ".join(problems))


__all__ = ["GuardConfig", "TargetConfig", "SERVED_BY", "check_signature", "load_guard_config"]
