"""What the exporter reads of a guard's configuration: the model it guards, the limits its
goldens are judged against (``validator.*``) and the judge's operator-owned limits (``judge.*``),
resolved through the same layers the guard resolves them with."""

from __future__ import annotations

from pathlib import Path

from exporter.errors import ExporterError
from exporter.rollout.judge import parse_margin
from tritonguard.core import repository
from tritonguard.core.config import from_params, layered_parameters, model_parameters
from tritonguard.core.errors import ConfigError
from tritonguard.rollout.judging import SOURCES, JudgeConfig
from tritonguard.rollout.validators import ValidatorConfig


class NotAGuard(ExporterError, ValueError):
    """The model named is not in the repository, or is not served by a guard."""


class GuardSettingsError(ExporterError):
    """A guard setting the exporter reads (judge.*) is out of its range."""


def guard_target(repo: Path, model: str) -> str:
    cfg_path = repo / model / repository.CONFIG
    if not cfg_path.exists():
        raise NotAGuard(f"no model '{model}' in {repo}")
    found = repository.guard_dir(repo, model)
    if found is None:
        cfg = repository.read_config(repo / model)
        raise NotAGuard(f"'{model}' is not a guard model (backend {cfg.get('backend') or cfg.get('platform')!r})")
    return found[1]["parameters"]["target"]["string_value"]


def validator_limits(repo: Path, model: str):
    """The guard's ``validator.*`` settings (the limits its goldens are judged against), from
    the guard's config.pbtxt (``NAME_guard`` for a text model); the defaults when unreadable."""

    try:
        found = repository.guard_dir(Path(repo), model)
        if found is None:
            return ValidatorConfig()
        params = {k[len("validator."):]: v.get("string_value", "")
                  for k, v in (found[1].get("parameters") or {}).items() if k.startswith("validator.")}
        return from_params(ValidatorConfig, params, section="validator", model=model)
    except Exception:  # noqa: BLE001 - only for display: the defaults are what a guard would use
        return ValidatorConfig()


class JudgeLimits:
    """The judge's operator-owned limits for one promote, and where each came from."""

    def __init__(self, cfg, sources: dict[str, str]):
        self.max_disagreement = cfg.max_disagreement
        self.min_cosine = cfg.min_cosine
        self.max_slice_regression = cfg.max_slice_regression
        self.sources = sources


def judge_limits(repo: Path, model: str, *, max_disagreement: str | None = None,
                 min_cosine: float | None = None, max_slice_regression: str | None = None) -> JudgeLimits:
    """Flags > the guard's ``judge.*`` (resolved as the guard resolves its parameters:
    [tool.tritonguard.judge] < TRITONGUARD_JUDGE__* < config.pbtxt) > the defaults of
    :mod:`tritonguard.rollout.judging`. A value out of its range raises :class:`GuardSettingsError`."""
    found = repository.guard_dir(Path(repo), model)
    params = layered_parameters(model_parameters(found[1]) if found else {}, Path(repo))
    mine = {k[len("judge."):]: v for k, v in params.items() if k.startswith("judge.")}
    sources = {k: f"judge.{k} from {params.source_of('judge.' + k)}" for k in mine}
    flags = {"max_disagreement": None if max_disagreement is None else parse_margin(max_disagreement, "--max-disagreement"),
             "min_cosine": min_cosine,
             "max_slice_regression": None if max_slice_regression is None
             else parse_margin(max_slice_regression, "--max-slice-regression")}
    for key, value in flags.items():
        if value is not None:
            mine[key] = str(value)
            sources[key] = f"--{key.replace('_', '-')}"
    try:
        cfg = from_params(JudgeConfig, mine, section="judge", model=model)
    except ConfigError as exc:
        raise GuardSettingsError(str(exc)) from None
    return JudgeLimits(cfg, {k: sources.get(k, SOURCES[k]) for k in SOURCES})
