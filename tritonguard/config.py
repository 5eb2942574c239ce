"""Config of a Python-based backend model, from config.pbtxt ``parameters``.

Each component owns one kw-only dataclass and a key prefix (``validation.max_payload_bytes``);
:func:`split_parameters` hands every component its keys and rejects any key that no component
claims, naming it, so a misspelt parameter fails the model load instead of being ignored.
"""

from __future__ import annotations

import dataclasses
import json
import os
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any

from .errors import ConfigError

ENV_PREFIX = "TRITONGUARD_"


def model_parameters(model_config: Mapping[str, Any]) -> dict[str, str]:
    """``parameters { key: "k" value { string_value: "v" } }`` -> ``{"k": "v"}``."""
    out: dict[str, str] = {}
    for key, value in (model_config.get("parameters") or {}).items():
        if isinstance(value, Mapping):
            out[key] = str(value.get("string_value", ""))
        else:
            out[key] = str(value)
    return out


def env_parameters(prefix: str = ENV_PREFIX, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``TRITONGUARD_VALIDATION__MAX_PAYLOAD_BYTES=…`` -> ``{"validation.max_payload_bytes": …}``.

    Environment values sit below per-model parameters: they set fleet-wide defaults.
    """
    env = os.environ if environ is None else environ
    out: dict[str, str] = {}
    for key, value in env.items():
        if key.startswith(prefix) and "__" in key:
            out[key[len(prefix):].lower().replace("__", ".")] = value
    return out


def split_parameters(params: Mapping[str, str], prefixes: Iterable[str], *, model: str) -> dict[str, dict[str, str]]:
    """Group ``params`` by component prefix ("" for top-level keys); unknown prefixes fail."""
    groups: dict[str, dict[str, str]] = {p: {} for p in prefixes}
    for key, value in params.items():
        head, _, tail = key.partition(".")
        if tail and head in groups:
            groups[head][tail] = value
        elif not tail and "" in groups:
            groups[""][key] = value
        else:
            known = sorted(p for p in groups if p)
            raise ConfigError(
                f"model '{model}': unknown parameter '{key}' (known sections: {', '.join(known)})"
            )
    return groups


def _coerce(raw: str, typ: Any, key: str) -> Any:
    origin = typing.get_origin(typ)
    args = typing.get_args(typ)
    if origin is typing.Union or origin is types.UnionType:
        inner = [a for a in args if a is not type(None)]
        if raw.strip().lower() in ("", "none", "null"):
            return None
        return _coerce(raw, inner[0], key)
    try:
        if typ is bool:
            low = raw.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError(f"expected true/false, got {raw!r}")
        if typ is int:
            return int(raw)
        if typ is float:
            return float(raw)
        if typ is str:
            return raw
        if origin in (dict, Mapping) or typ is dict:
            val = json.loads(raw)
            if not isinstance(val, dict):
                raise ValueError("expected a JSON object")
            return val
        if origin in (tuple, list) or typ in (tuple, list):
            return tuple(s.strip() for s in raw.split(",") if s.strip())
    except (ValueError, json.JSONDecodeError) as exc:
        raise ConfigError(f"parameter '{key}': {exc}") from None
    raise ConfigError(f"parameter '{key}': unsupported type {typ}")


def from_params(cls: type, params: Mapping[str, str], *, section: str = "", model: str = "?"):
    """Build the kw-only dataclass ``cls`` from string parameters; unknown keys fail."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for key, raw in params.items():
        full = f"{section}.{key}" if section else key
        name = key
        dyn = getattr(cls, "DYNAMIC_PREFIXES", ())
        base = key.split(".", 1)[0]
        if base in dyn and "." in key:
            kwargs.setdefault(base, {})[key.split(".", 1)[1]] = raw
            continue
        if name not in fields or name in dyn:
            raise ConfigError(
                f"model '{model}': unknown parameter '{full}' "
                f"(known: {', '.join(sorted((f'{section}.' if section else '') + k for k in fields))})"
            )
        kwargs[name] = _coerce(raw, hints[name], full)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"model '{model}': {exc}") from None
