"""The config.pbtxt files of one export: built from :mod:`exporter.build.layout`, checked the way
the guard checks them at load, merged over the existing files (the user's settings kept), and
refused where they would turn an existing model into another kind.
"""

from __future__ import annotations

import json
from pathlib import Path

from exporter.build import layout
from exporter.build.errors import ExportError
from exporter.build.sources.spec import ExportSpec
from tritonguard.core import repository as repo_mod
from tritonguard.core.config import layered_parameters, model_parameters
from tritonguard.core.tensors import ModelSignature
from tritonguard.guard.config import GuardConfig, check_signature


def build_configs(spec: ExportSpec, names: dict[str, str], native: bool = False) -> dict[str, dict]:
    """All config dicts, validated (protobuf schema and guard-vs-target contract) up front."""

    raw, guard = names["raw"], names["guard"]
    if spec.text is None:
        configs = {raw: layout.runtime_config(raw, spec, native=native)}
        # the guard runs a runtime artifact itself (no second hop); a native target needs BLS
        placement = "bls" if native else "inprocess"
    else:
        tok, enc = names["tokenizer"], names["encoder"]
        configs = {tok: layout.tokenizer_config(tok, spec),
                   enc: {**layout.runtime_config(enc, spec, threads=layout.ENCODER_THREADS, native=native),
                         "version_policy": layout.ALL_VERSIONS},
                   raw: layout.ensemble_config(raw, spec, tok, enc)}
        # the guard runs the tokenizer -> encoder ensemble itself (tritonguard.models.chain): its
        # one instance no longer idles through two more stub hops per batch (layout.py, issue 33);
        # a native encoder (Triton's onnxruntime backend) is reached by BLS
        placement = "bls" if native else "inprocess"
    configs[guard] = layout.guard_config(guard, spec, raw, placement=placement,
                                         serves_as=names.get("front", ""))
    if "front" in names:
        configs[names["intake"]] = layout.intake_config(names["intake"], configs[guard])
        configs[names["front"]] = layout.front_config(names["front"], configs[guard], names["intake"], guard)
    for cfg in configs.values():
        layout.render(cfg)
    sig = ModelSignature.from_config(configs[guard])
    try:
        check_signature(sig, ModelSignature.from_config(configs[raw]), raw)
        GuardConfig.from_parameters(model_parameters(configs[guard]), guard).validation.check_against(sig, guard)
    except Exception as exc:  # ConfigError: a spec the guard could not load
        raise ExportError(str(exc)) from None
    return configs


# what each kind of model keeps of its existing config.pbtxt (see layout.merge)
_OWNS = {"tokenizer": layout.TOKENIZER_OWNS, "encoder": layout.ENCODER_OWNS, "guard": layout.GUARD_OWNS,
         "intake": layout.INTAKE_OWNS, "front": layout.ENSEMBLE_OWNS}


def merge_existing(repository: Path, configs: dict[str, dict], names: dict[str, str],
                    planned: dict[str, dict] | None = None) -> tuple[dict[str, dict], list[str]]:
    """``configs`` merged over the existing config.pbtxt files (user settings kept), and the
    notices of every value that differed. The merged guard is checked as the guard will check
    it at load, so kept settings that no longer fit (a range on a vanished input) fail here."""
    merged, notices = {}, []

    def existing(model: str) -> dict | None:
        path = repository / model / repo_mod.CONFIG
        return (planned or {}).get(model) or (
            repo_mod.read_config(repository / model) if path.exists() else None)  # readable: check_existing

    guard = names["guard"]
    # the guard's placement as it will be (a kept `placement: bls` counts): it decides what the
    # target must keep loaded
    placement = guard_placement(layout.merge(existing(guard), configs[guard], _OWNS["guard"])[0])
    for role, model in names.items():
        cfg, old, upgraded = configs[model], existing(model), []
        if role == "raw" and "tokenizer" in names:
            owns = layout.ENSEMBLE_OWNS
        elif role == "raw":
            owns = layout.RUNTIME_OWNS
            cfg = {**cfg, "version_policy": layout.target_version_policy(placement)}
            fixed = bls_target_policy(old.get("version_policy") if old else None, placement)
            if old is not None and fixed is not None:
                old = {**old, "version_policy": fixed}
                upgraded = [f"set version_policy {json.dumps(fixed, separators=(',', ':'))} (was latest 1: the "
                            "guard reaches it over BLS, and a rollout needs every version it names loaded)"]
        else:
            owns = _OWNS[role]
        merged[model], said = layout.merge(old, cfg, owns)
        notices += [f"{model}: {n}" for n in upgraded + said]
    try:
        for cfg in merged.values():
            layout.render(cfg)
        _check_guard(merged[guard], guard)
    except Exception as exc:  # noqa: BLE001 - ConfigError, or a protobuf ParseError on a kept field
        raise ExportError(f"the settings kept from {repository / guard}/{repo_mod.CONFIG} do not fit this "
                          f"export: {exc} (fix or remove them, then export again)") from None
    return merged, notices


def bls_target_policy(policy: dict | None, placement: str) -> dict | None:
    """The policy that replaces a target's ``policy`` kept from an existing config (or a
    published repository's ``version_policy.json``), or None to keep it. Only ``latest
    {num_versions: 1}`` on a target reached over BLS is replaced: what exports wrote before
    issue 39 item 10, and a policy under which loading a rollout's candidate unloads its primary.
    Any other policy a user chose (``latest`` N > 1, ``specific``) is theirs to keep."""
    if placement != "bls" or policy is None or layout.canonical({"version_policy": policy}) != layout.canonical(
            {"version_policy": layout.LATEST_ONLY}):
        return None
    return layout.target_version_policy(placement)


def guard_placement(guard: dict) -> str:
    """A guard config's placement (the guard's default, ``bls``, when it says none)."""
    return model_parameters(guard).get("placement", "bls")


def _check_guard(cfg: dict, guard: str) -> None:
    sig = ModelSignature.from_config(cfg)
    GuardConfig.from_parameters(model_parameters(cfg), guard).validation.check_against(sig, guard)


def defer_to_lower_layers(guard: dict, repository: Path) -> None:
    """Drop the export's computed guard settings that the user already sets in a lower layer
    ([tool.tritonguard] or TRITONGUARD_*): config.pbtxt would otherwise override them."""

    if "validation.max_payload_bytes" in layered_parameters({}, repository):
        (guard.get("parameters") or {}).pop("validation.max_payload_bytes", None)


def _kind(cfg: dict) -> str:
    return cfg.get("backend") or cfg.get("platform") or "?"


def check_existing(repository: Path, configs: dict[str, dict], planned: dict[str, dict] | None = None) -> None:
    """Refuse to turn an existing model into another kind (e.g. a runtime model into an
    ensemble, or a target into a guard): its old versions would no longer match its config.
    ``planned``: configs :func:`upgrade_plan` will write (they count as the existing ones)."""
    for model, cfg in configs.items():
        if model in (planned or {}):
            if _kind(planned[model]) != _kind(cfg):
                raise ExportError(f"model '{model}' would be '{_kind(planned[model])}' after the layout "
                                  f"upgrade; this export would make it '{_kind(cfg)}' (choose another --name)")
            continue
        if not (repository / model / repo_mod.CONFIG).exists():
            continue
        try:
            old = _kind(repo_mod.read_config(repository / model))
        except Exception as exc:  # noqa: BLE001 - a broken config must be fixed by hand, not overwritten
            raise ExportError(f"{repository / model}/config.pbtxt cannot be read ({exc})") from None
        if old != _kind(cfg):
            raise ExportError(f"model '{model}' already exists as '{old}'; this export would make it "
                              f"'{_kind(cfg)}' (choose another --name)")
