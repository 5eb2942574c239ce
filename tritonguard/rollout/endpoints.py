"""Versions of a stream guard's target served outside Triton, by URL (an OpenAI-compatible
server: vLLM, TGI, ``transformers serve``), so a rollout can move traffic from a Triton
generator to another runtime, version by version, and judge them like any two versions.

They are declared in ``<repository>/<target>/endpoints.json``, beside the target's
``config.pbtxt``::

    {"format_version": 1,
     "versions": {"7": {"url": "http://10.0.0.5:8000/v1", "model": "meta-llama/Llama-3.1-8B-Instruct",
                        "api_key_env": "VLLM_API_KEY"}}}

Why a file beside config.pbtxt and not a version folder: Triton loads every numeric folder of a
model (``version_policy { all {} }``), or the highest one (the default policy), and one version
that fails to load fails the whole model's load (model_lifecycle.cc unloads every version it
loaded with it). A folder ``7/`` with no model in it would take the Triton versions down, or,
under the default policy, become the only one Triton tries. Triton ignores a file beside
config.pbtxt, and the guard, which reads the target's folder already (goldens, manifests), finds it
there. A declared version number may therefore not be a folder of the target.

- ``url``: the server's base URL (``http(s)://host[:port]/v1``; no credentials in it);
  ``model``: the model name the server serves (default: the target's name); ``api_key_env`` or
  ``api_key_file``: where the guard reads its API key (never the key itself); ``judge``: how a
  rollout compares it with the primary (``task`` by default: another runtime's text differs by
  nature, so live disagreement is reported, not judged).
- The guards re-read the file when it changes (a ``stat`` at most every
  :data:`CHECK_INTERVAL_S`), so a version declared while they serve is routable without a reload.
- ``python -m exporter endpoint`` writes and removes declarations.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
import urllib.parse
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tritonguard.core.files import atomic_write

log = logging.getLogger(__name__)

ENDPOINTS_FILE = "endpoints.json"
FORMAT_VERSION = 1
CHECK_INTERVAL_S = 1.0
JUDGES = ("task", "equivalence")  # tritonguard.rollout.state.JUDGES


class EndpointError(ValueError):
    """An unreadable or invalid ``endpoints.json``, or a declaration that cannot be made."""


def check_url(url: str) -> str:
    """``url`` without a trailing slash; ValueError when it is not http(s)://host[:port][/path],
    or carries credentials (they would end up in log lines: use ``target_api_key_env``)."""
    parts = urllib.parse.urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"parameter 'target_url' must be http(s)://host[:port]/v1, got {url!r}")
    if parts.username or parts.password or parts.query or parts.fragment:
        raise ValueError("parameter 'target_url' must not carry credentials, a query or a fragment "
                         "(the API key goes in target_api_key_env or target_api_key_file)")
    try:
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError:
        raise ValueError(f"parameter 'target_url' has a bad port: {url!r}") from None
    return url.strip().rstrip("/")


@dataclass(frozen=True)
class Endpoint:
    """One version of the target, served at ``url``."""

    version: int
    url: str
    model: str = ""
    api_key_env: str = ""
    api_key_file: str = ""
    judge: str = "task"

    def __post_init__(self) -> None:
        if self.version < 1:
            raise EndpointError(f"an endpoint version must be >= 1, got {self.version}")
        try:
            object.__setattr__(self, "url", check_url(self.url))
        except ValueError as exc:
            raise EndpointError(f"v{self.version}: {exc}".replace("parameter 'target_url'", "url")) from None
        if self.api_key_env and self.api_key_file:
            raise EndpointError(f"v{self.version}: api_key_env and api_key_file exclude each other")
        if self.judge not in JUDGES:
            raise EndpointError(f"v{self.version}: judge must be one of {', '.join(JUDGES)}, got {self.judge!r}")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        del d["version"]
        return {k: v for k, v in d.items() if v}

    def manifest(self, target: str) -> dict[str, Any]:
        """What a version folder's manifest.json says, for the registry and the rollout's judge
        (``task: generation``; ``endpoint`` marks it as served at a URL: no artifact to run). Its
        ``sha256`` is the hash of what is served, the URL and the model name: the registry keeps a
        version number bound to it, so one number never names two servers."""
        served = {"url": self.url, "model": self.model or target}
        sha = hashlib.sha256(json.dumps(served, sort_keys=True).encode()).hexdigest()
        return {"format_version": FORMAT_VERSION, "name": target, "version": self.version, "task": "generation",
                "judge": self.judge, "format": "openai", "source": ENDPOINTS_FILE, "sha256": sha,
                "endpoint": served}


def _parse(doc: Any, where: str) -> dict[int, Endpoint]:
    if not isinstance(doc, dict) or not isinstance(doc.get("versions"), dict):
        raise EndpointError(f"{where}: expected {{\"format_version\": 1, \"versions\": {{\"N\": {{\"url\": ...}}}}}}")
    if doc.get("format_version", FORMAT_VERSION) != FORMAT_VERSION:
        raise EndpointError(f"{where}: format_version {doc.get('format_version')!r} is not {FORMAT_VERSION}")
    out: dict[int, Endpoint] = {}
    for key, entry in doc["versions"].items():
        if not str(key).isdigit() or not isinstance(entry, dict):
            raise EndpointError(f"{where}: version {key!r}: expected a version number and {{\"url\": ...}}")
        unknown = set(entry) - {"url", "model", "api_key_env", "api_key_file", "judge"}
        if unknown:
            raise EndpointError(f"{where}: version {key}: unknown key(s) {', '.join(sorted(unknown))}")
        try:
            out[int(key)] = Endpoint(version=int(key), **{k: str(v) for k, v in entry.items()})
        except EndpointError as exc:
            raise EndpointError(f"{where}: {exc}") from None
    return out


def read_endpoints(model_dir: str | os.PathLike) -> dict[int, Endpoint]:
    """The versions of the target in ``model_dir`` served at a URL ({} without the file)."""
    path = Path(model_dir) / ENDPOINTS_FILE
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise EndpointError(f"cannot read {path}: {exc}") from None
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise EndpointError(f"{path}: not JSON ({exc})") from None
    return _parse(doc, str(path))


def endpoint_of(model_dir: str | os.PathLike, version: int) -> Endpoint | None:
    """``version``'s declaration, or None (a Triton version, or no such version)."""
    return read_endpoints(model_dir).get(int(version))


def declare(model_dir: str | os.PathLike, endpoint: Endpoint) -> None:
    """Add or replace ``endpoint`` in ``endpoints.json`` (written atomically). A version that is
    a folder of the target (a Triton version) cannot be declared."""
    model_dir = Path(model_dir)
    if (model_dir / str(endpoint.version)).exists():
        raise EndpointError(f"v{endpoint.version} is a version folder of {model_dir} (served by Triton): "
                            "a version served at a URL takes a number of its own")
    current = read_endpoints(model_dir)
    current[endpoint.version] = endpoint
    _write(model_dir, current)


def withdraw(model_dir: str | os.PathLike, version: int) -> bool:
    """Remove ``version``'s declaration; False when there was none."""
    model_dir = Path(model_dir)
    current = read_endpoints(model_dir)
    if current.pop(int(version), None) is None:
        return False
    _write(model_dir, current)
    return True


def _write(model_dir: Path, endpoints: dict[int, Endpoint]) -> None:
    model_dir.mkdir(parents=True, exist_ok=True)
    doc = {"format_version": FORMAT_VERSION,
           "versions": {str(v): e.to_dict() for v, e in sorted(endpoints.items())}}
    atomic_write(model_dir / ENDPOINTS_FILE, json.dumps(doc, indent=1) + "\n")


class EndpointsView:
    """``endpoints.json`` of one target as a serving process sees it: re-read when its mtime or
    size changes, looked at (one ``stat``) at most every ``check_s`` seconds; an unreadable file
    keeps the last good declarations (logged once per change)."""

    def __init__(self, model_dir: str | os.PathLike, *, check_s: float = CHECK_INTERVAL_S,
                 clock: Any = time.monotonic) -> None:
        self.path = Path(model_dir) / ENDPOINTS_FILE
        self.check_s, self.clock = check_s, clock
        self._lock = threading.Lock()
        self._next = -float("inf")
        self._stamp: tuple[int, int] | None = None
        self.endpoints: dict[int, Endpoint] = {}

    def get(self, version: int) -> Endpoint | None:
        now = self.clock()
        if now >= self._next:
            with self._lock:
                if now >= self._next:
                    self._next = now + self.check_s
                    self._reload()
        return self.endpoints.get(int(version))

    def _reload(self) -> None:
        try:
            st = self.path.stat()
        except OSError:
            if self.endpoints:
                log.info("%s is gone: no version is served at a URL any more", self.path)
            self._stamp, self.endpoints = None, {}
            return
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp == self._stamp:
            return
        self._stamp = stamp
        try:
            self.endpoints = read_endpoints(self.path.parent)
        except EndpointError as exc:
            log.warning("%s; the previous declarations stay in force", exc)
            return
        log.info("versions served at a URL: %s", ", ".join(f"v{v} {e.url}" for v, e in sorted(self.endpoints.items()))
                 or "none")
