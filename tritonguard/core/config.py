"""Config of a Python-based backend model, from config.pbtxt ``parameters``.

Each component owns one kw-only dataclass and a key prefix (``validation.max_payload_bytes``);
:func:`split_parameters` hands every component its keys and rejects any key that no component
claims, naming it, so a misspelt parameter fails the model load instead of being ignored.
:func:`from_params` types the strings with a pydantic model of the dataclass's fields
(``extra="forbid"``); the dataclass's ``__post_init__`` then checks what types cannot say.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Json, ValidationError, create_model

from tritonguard.core.errors import ConfigError

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


def _strip(raw: Any) -> Any:
    return raw.strip() if isinstance(raw, str) else raw


def _none(raw: Any) -> Any:
    return None if isinstance(raw, str) and raw.strip().lower() in ("", "none", "null") else raw


def _split(raw: Any) -> Any:
    return tuple(s.strip() for s in raw.split(",") if s.strip()) if isinstance(raw, str) else raw


def _wire(typ: Any, dynamic: bool) -> Any:
    """The type of a field as parameters spell it: "a,b" for tuples, JSON for objects, "none"."""
    if dynamic:  # ``range.IMAGE = "0,16"``: raw strings, parsed by the dataclass itself
        return dict[str, str]
    origin = typing.get_origin(typ)
    if origin is typing.Union or origin is types.UnionType:
        inner = [a for a in typing.get_args(typ) if a is not type(None)]
        return Annotated[_wire(inner[0], False) | None, BeforeValidator(_none)]
    if origin in (tuple, list) or typ in (tuple, list):
        return Annotated[typ, BeforeValidator(_split)]
    if origin in (dict, Mapping) or typ is dict:
        return Json[typ]
    return Annotated[typ, BeforeValidator(_strip)] if typ in (bool, int, float) else typ


_MODELS: dict[type, type[BaseModel]] = {}


def _model(cls: type) -> type[BaseModel]:
    """A pydantic model of the fields of the dataclass ``cls`` as strings set them; unknown keys
    are forbidden. Built once per class and process (a few ms); defaults stay the dataclass's own."""
    model = _MODELS.get(cls)
    if model is None:
        hints, dyn = typing.get_type_hints(cls), getattr(cls, "DYNAMIC_PREFIXES", ())
        fields: dict[str, Any] = {f.name: (_wire(hints[f.name], f.name in dyn), None) for f in dataclasses.fields(cls)}
        model = create_model(f"{cls.__name__}Parameters", __config__=ConfigDict(extra="forbid"), **fields)
        _MODELS[cls] = model
    return model


_RULES = {"bool_parsing": "expected true/false", "dict_type": "expected a JSON object"}


def _problem(err: Any, section: str, known: Iterable[str], dynamic: Iterable[str], model: str) -> str:
    """One pydantic error as this module words it: the full key in quotes, then the rule."""
    key = ".".join(str(p) for p in err["loc"])
    full = f"{section}.{key}" if section else key
    if err["type"] == "extra_forbidden":
        return f"model '{model}': unknown parameter '{full}' (known: {', '.join(sorted(known))})"
    rule = f"expected keys like '{full}.<NAME>'" if key in dynamic else _RULES.get(err["type"], err["msg"])
    return f"model '{model}': parameter '{full}': {rule}, got {err['input']!r}"


def from_params(cls: type, params: Mapping[str, str], *, section: str = "", model: str = "?"):
    """Build the kw-only dataclass ``cls`` from string parameters; unknown keys fail."""
    kwargs: dict[str, Any] = {}
    dyn = getattr(cls, "DYNAMIC_PREFIXES", ())
    for key, raw in params.items():
        base, dot, rest = key.partition(".")
        if dot and base in dyn:
            kwargs.setdefault(base, {})[rest] = raw
        else:
            kwargs[key] = raw
    schema = _model(cls)
    try:
        parsed = schema.model_validate(kwargs)
    except ValidationError as exc:
        known = ((f"{section}." if section else "") + k for k in schema.model_fields)
        raise ConfigError(_problem(exc.errors()[0], section, known, dyn, model)) from None
    try:
        return cls(**{k: getattr(parsed, k) for k in parsed.model_fields_set})
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"model '{model}': {exc}") from None


# -- layered parameters -------------------------------------------------------------------------
PYPROJECT_ENV = "TRITONGUARD_PYPROJECT"
PYPROJECT_TABLE = ("tool", "tritonguard")


def _toml_load(path: Path) -> dict[str, Any]:
    try:
        import tomllib  # noqa: PLC0415 - Python >= 3.11
    except ModuleNotFoundError:  # pragma: no cover - Python 3.10
        try:
            import tomli as tomllib  # noqa: PLC0415
        except ModuleNotFoundError:
            raise ConfigError(f"{path}: reading [tool.tritonguard] needs Python >= 3.11 or the "
                              "'tomli' package") from None
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except (OSError, ValueError) as exc:  # TOMLDecodeError is a ValueError
        raise ConfigError(f"{path}: cannot read [tool.tritonguard]: {exc}") from None


def _toml_value(value: Any, key: str, source: str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float, str)):
        return str(value)
    if isinstance(value, list) and all(isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in value):
        return ",".join(str(v) for v in value)  # tuple parameters: "a,b,c"
    if isinstance(value, dict):
        return json.dumps(value)  # object parameters (tenancy.quotas) take JSON
    raise ConfigError(f"{source}: '{key}' has an unsupported value {value!r}")


def _flatten(table: Mapping[str, Any], prefix: str, source: str, out: dict[str, str]) -> None:
    """``{"validation": {"max_bytes_length": 4096, "range": {"IMAGE": "0,16"}}}`` ->
    ``validation.max_bytes_length``, ``validation.range.IMAGE``. A table whose values are
    tables themselves (``tenancy.quotas = {acme = {rps = 5}}``) is one JSON-valued parameter."""
    for key, value in table.items():
        full = f"{prefix}{key}"
        # a section is always a table of keys; below it, only a table of plain values nests
        if isinstance(value, dict) and (not prefix or not any(isinstance(v, dict) for v in value.values())):
            _flatten(value, f"{full}.", source, out)
        else:
            out[full] = _toml_value(value, full, source)


def pyproject_path(repo_dir: str | os.PathLike[str] | None,
                   environ: Mapping[str, str] | None = None) -> Path | None:
    """``$TRITONGUARD_PYPROJECT`` (must exist), else ``<repository>/../pyproject.toml`` if present."""
    env = os.environ if environ is None else environ
    explicit = env.get(PYPROJECT_ENV, "")
    if explicit:
        path = Path(explicit)
        if not path.is_file():
            raise ConfigError(f"${PYPROJECT_ENV}={explicit}: no such file")
        return path
    if repo_dir is None:
        return None
    path = Path(repo_dir).resolve().parent / "pyproject.toml"
    return path if path.is_file() else None


def pyproject_parameters(path: Path | None) -> dict[str, str]:
    """``[tool.tritonguard]`` of ``path`` flattened to ``section.key`` strings ({} without one)."""
    if path is None:
        return {}
    table: Any = _toml_load(path)
    for part in PYPROJECT_TABLE:
        table = table.get(part) if isinstance(table, dict) else None
        if table is None:
            return {}
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: [tool.tritonguard] must be a table")
    out: dict[str, str] = {}
    _flatten(table, "", f"{path} [tool.tritonguard]", out)
    return out


class LayeredParameters(dict):
    """Resolved parameters; ``sources[key]`` names the layer each value came from."""

    sources: dict[str, str]

    def source_of(self, key: str) -> str:
        return self.sources.get(key, "defaults")


def layered_parameters(model_params: Mapping[str, str], repo_dir: str | os.PathLike[str] | None,
                       environ: Mapping[str, str] | None = None) -> LayeredParameters:
    """The one place where a guard's parameters are resolved, lowest precedence first:
    dataclass defaults < ``[tool.tritonguard]`` of a pyproject.toml (``$TRITONGUARD_PYPROJECT``,
    else the model repository's parent folder) < ``TRITONGUARD_<SECTION>__<KEY>`` environment
    variables < the model's own config.pbtxt ``parameters``. Unknown keys are rejected later, by
    :func:`split_parameters` / :func:`from_params`, naming the key."""
    env = os.environ if environ is None else environ
    py = pyproject_path(repo_dir, env)
    out = LayeredParameters()
    out.sources = {}
    for label, layer in ((f"{py} [tool.tritonguard]", pyproject_parameters(py)),
                         ("environment (TRITONGUARD_*)", env_parameters(environ=env)),
                         ("config.pbtxt", dict(model_params))):
        for key, value in layer.items():
            out[key] = value
            out.sources[key] = label
    return out


def with_source(message: str, params: Any) -> str:
    """Name the layer (pyproject.toml, environment, config.pbtxt) of a key a config error quotes."""
    sources = getattr(params, "sources", {})
    for key, source in sources.items():
        if f"'{key}'" in message and source != "config.pbtxt":
            return f"{message} (set in {source})"
    return message


# -- where each setting came from, as the load logs it ------------------------------------------
SECRET = "<set>"
# a key whose value is itself a credential (a webhook URL carries its token in the path)
_SECRET_KEY = re.compile(r"secret|password|passwd|token|credential|webhook|api_?key|private", re.IGNORECASE)
# ... unless the key names where the secret is (a variable, a file, a header), not the secret
_SECRET_REFERENCE = ("_env", "_file", "_header")
_URL_USERINFO = re.compile(r"://[^/?#@\s]*@")
_URL_SECRET_QUERY = re.compile(r"[?&][^=&]*(?:secret|password|token|sig|key|auth|credential)[^=&]*=", re.IGNORECASE)
SHOWN_MAX = 80


def shown_value(key: str, value: str) -> str:
    """``value`` as a log line may show it: :data:`SECRET` for a credential (a key named like one,
    a URL with a user or password, a URL whose query carries a token or signature), else the
    value, cut at :data:`SHOWN_MAX` characters."""
    name = key.rsplit(".", 1)[-1]
    if _SECRET_KEY.search(name) and not name.endswith(_SECRET_REFERENCE):
        return SECRET
    if _URL_USERINFO.search(value) or ("://" in value and _URL_SECRET_QUERY.search(value)):
        return SECRET
    return value if len(value) <= SHOWN_MAX else value[:SHOWN_MAX - 1] + "\u2026"


def _default_of(obj: Any, name: str) -> Any:
    for f in dataclasses.fields(obj):
        if f.name == name:
            if f.default is not dataclasses.MISSING:
                return f.default
            if f.default_factory is not dataclasses.MISSING:
                return f.default_factory()
    return dataclasses.MISSING


def non_default_settings(params: Mapping[str, str], sections: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """``(key, value as shown, source)`` of each key a layer set to something else than its
    default, by key. ``sections`` maps each key prefix ("" for top-level keys) to the dataclass
    built from it: a key whose parsed value equals the field's default is left out; keys below a
    dynamic prefix (``validation.range.IMAGE``) and keys no dataclass field names are kept."""
    source_of = getattr(params, "source_of", lambda _key: "?")
    out = []
    for key in sorted(params):
        head, dot, tail = key.partition(".")
        section, name = (head, tail) if dot and head in sections else ("", key)
        obj = sections.get(section)
        if obj is not None and dataclasses.is_dataclass(obj) and "." not in name:
            default = _default_of(obj, name)
            if default is not dataclasses.MISSING and getattr(obj, name, dataclasses.MISSING) == default:
                continue
        out.append((key, shown_value(key, params[key]), source_of(key)))
    return out


def settings_line(model: str, params: Mapping[str, str], sections: Mapping[str, Any]) -> str:
    """One log line per model load: each non-default setting and the layer it came from
    (config.pbtxt, ``TRITONGUARD_*``, or a pyproject.toml, named by its path), secrets as
    :data:`SECRET`. A pyproject.toml beside the model repository is read without being asked
    for; this line is where an operator sees what it changed."""
    items = non_default_settings(params, sections)
    listed = ", ".join(f"{key}={value} ({source})" for key, value, source in items)
    return f"{model}: non-default settings: {listed or 'none'}"
