"""The vLLM backend's I/O contract, shared by the generator and the guard in front of any
decoupled generator: the inputs (``text_input``, ``stream``, ``sampling_parameters``,
``exclude_input_in_output``), the output ``text_output``, the sampling keys and their rules, and
what a sink of one request's responses must do.
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from tritonguard.core.errors import InvalidInput

INPUTS = ("text_input", "stream", "sampling_parameters", "exclude_input_in_output")
OUTPUT = "text_output"
SAMPLING_KEYS = ("max_tokens", "temperature", "top_p", "seed", "stop")
SEED_LIMIT = 2**63
# ``stop``: a string or a list of strings, as vLLM's SamplingParams takes it; the answer ends
# before the first one, which is never sent (vLLM's default, include_stop_str_in_output false)
MAX_STOPS = 16
MAX_STOP_CHARS = 256
# A request whose id is this prefix and another request's id stops that generation (its stream
# ends with a plain final response): how a BLS caller on python_backend 24.10, whose response
# iterator has no cancel(), tells a ``generator`` target to stop (the stream guard's output rails)
STOP_PREFIX = "tritonguard-stop:"
# ... and the way the stream guard uses first: an empty file named after the request's id in
# :func:`stop_dir`, which the generator's decode thread lists every 5 ms. A stop request is
# a BLS exec(decoupled=True), and on python_backend 24.10 opening one while another thread of the
# same stub reads a response iterator that is being fed can deadlock the stub (the opener holds
# the GIL waiting for the stub's iterator-map mutex; the message monitor holds that mutex waiting
# for the iterator's own; the reader holds that one waiting for the GIL): gdb showed exactly that
# after a client's cancel, one cancel in ~50-400 under load, and the generator then froze too.
STOP_ID = re.compile(r"[A-Za-z0-9_.-]{1,128}")


def stop_dir() -> Path | None:
    """The directory of stop files shared by the models of this tritonserver (a BLS caller and
    its target are stubs of the same server: the stub's parent). None when it cannot be used:
    not creatable, or not ours (another user's directory is never trusted)."""
    base = Path("/dev/shm") if os.path.isdir("/dev/shm") else Path(tempfile.gettempdir())
    path = base / f"tritonguard-stops-{os.getuid()}-{os.getppid()}"
    try:
        path.mkdir(mode=0o700, exist_ok=True)
        st = path.stat()
    except OSError:
        return None
    return path if st.st_uid == os.getuid() and not (st.st_mode & 0o022) else None


def write_stop(directory: Path, request_id: str) -> bool:
    """Ask the generator serving ``request_id`` to stop it (see :data:`STOP_ID`); False when the
    file cannot be written (then send a stop request)."""
    if not STOP_ID.fullmatch(request_id):
        return False
    try:
        (directory / request_id).touch()
        return True
    except OSError:
        return False


# -- sampling parameters ------------------------------------------------------------------------
@dataclass(frozen=True)
class SamplingParams:
    """vLLM's defaults: 16 tokens, temperature 1, top_p 1, no seed (fresh entropy)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    given: tuple[str, ...] = field(default=(), compare=False)  # the keys the request set

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _bad(key: str, rule: str, value: Any) -> InvalidInput:
    return InvalidInput("sampling_parameters", f"key '{key}'", f"{rule}, got {value!r}")


def _as_int(key: str, value: Any, rule: str) -> int:
    # vLLM's backend also takes numbers sent as strings ("max_tokens": "64"); floats must be whole
    if isinstance(value, bool):
        raise _bad(key, rule, value)
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise _bad(key, rule, value) from None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int):
        raise _bad(key, rule, value)
    return value


def _as_float(key: str, value: Any, rule: str) -> float:
    if isinstance(value, bool):
        raise _bad(key, rule, value)
    try:
        f = float(value.strip()) if isinstance(value, str) else float(value)
    except (TypeError, ValueError):
        raise _bad(key, rule, value) from None
    if not math.isfinite(f):
        raise _bad(key, rule, value)
    return f


def _as_stops(value: Any) -> tuple[str, ...]:
    rule = f"must be a string or a list of at most {MAX_STOPS} strings of 1..{MAX_STOP_CHARS} characters"
    stops = [value] if isinstance(value, str) else value
    if (not isinstance(stops, list) or len(stops) > MAX_STOPS
            or not all(isinstance(x, str) and 0 < len(x) <= MAX_STOP_CHARS for x in stops)):
        raise _bad("stop", rule, value)
    return tuple(dict.fromkeys(stops))  # order kept, repeats dropped


def cut_at_stop(text: str, stops: tuple[str, ...] | list[str]) -> tuple[str, bool]:
    """``text`` up to its first stop sequence (excluded), and whether one was found."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


class StopScanner:
    """Cuts a streamed answer at the first stop sequence. It holds back the newest tokens while
    they may still begin one (the fewest whole tokens that cover the last ``len(longest) - 1``
    characters), never more, and keeps token boundaries, so a hold-back counted in tokens after
    it (the output rails') still counts tokens. Without stops every token passes unchanged."""

    def __init__(self, stops: tuple[str, ...] | list[str]) -> None:
        self.stops = tuple(stops)
        self.keep = max((len(s) for s in self.stops), default=1) - 1
        self.held: list[str] = []
        self.hit = False

    def feed_tokens(self, tokens: list[str]) -> list[str]:
        """The tokens that may go to the client now; at a stop sequence, those before it (the
        last one cut where it begins), ``hit`` set, and nothing after."""
        if not self.stops:
            return tokens
        if self.hit:
            return []
        self.held.extend(tokens)
        text = "".join(self.held)
        head, self.hit = cut_at_stop(text, self.stops)
        out: list[str] = []
        if self.hit:
            n = 0
            for t in self.held:
                if n + len(t) > len(head):
                    if len(head) > n:
                        out.append(head[n:])
                    break
                out.append(t)
                n += len(t)
            self.held = []
            return out
        rest = len(text)
        while self.held and rest - len(self.held[0]) >= self.keep:
            t = self.held.pop(0)
            rest -= len(t)
            out.append(t)
        return out

    def feed(self, piece: str) -> str:
        """:meth:`feed_tokens` for one piece of text, joined."""
        return "".join(self.feed_tokens([piece]))

    def flush_tokens(self) -> list[str]:
        """What is still held back, at the answer's end (it began no stop sequence)."""
        out, self.held = self.held, []
        return out

    def flush(self) -> str:
        return "".join(self.flush_tokens())


def parse_sampling(raw: str | bytes | None, *, max_tokens_cap: int, default_max_tokens: int = 16,
                   cap_name: str = "this model's max_tokens_cap") -> SamplingParams:
    """``sampling_parameters`` JSON -> :class:`SamplingParams`; every problem raises
    :class:`InvalidInput` naming the key and its rule."""
    default = SamplingParams(max_tokens=min(default_max_tokens, max_tokens_cap))
    if raw is None:
        return default
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidInput("sampling_parameters", "UTF-8", "the bytes are not valid UTF-8") from None
    if not raw.strip():
        return default
    try:
        obj = json.loads(raw)
    except ValueError as exc:
        raise InvalidInput("sampling_parameters", "JSON", f"not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise InvalidInput("sampling_parameters", "JSON object", f"got a JSON {type(obj).__name__}")
    unknown = sorted(set(obj) - set(SAMPLING_KEYS))
    if unknown:
        raise InvalidInput("sampling_parameters", "known keys",
                           f"unknown key '{unknown[0]}' (supported: {', '.join(SAMPLING_KEYS)})")
    kw: dict[str, Any] = {}
    if obj.get("max_tokens") is not None:
        rule = f"must be an integer in 1..{max_tokens_cap} ({cap_name})"
        n = _as_int("max_tokens", obj["max_tokens"], rule)
        if not 1 <= n <= max_tokens_cap:
            raise _bad("max_tokens", rule, obj["max_tokens"])
        kw["max_tokens"] = n
    if obj.get("temperature") is not None:
        rule = "must be a finite number >= 0 (0 = greedy)"
        t = _as_float("temperature", obj["temperature"], rule)
        if t < 0:
            raise _bad("temperature", rule, obj["temperature"])
        kw["temperature"] = t
    if obj.get("top_p") is not None:
        rule = "must be a number in (0, 1]"
        p = _as_float("top_p", obj["top_p"], rule)
        if not 0 < p <= 1:
            raise _bad("top_p", rule, obj["top_p"])
        kw["top_p"] = p
    if obj.get("seed") is not None:
        rule = f"must be an integer in 0..{SEED_LIMIT - 1}"
        s = _as_int("seed", obj["seed"], rule)
        if not 0 <= s < SEED_LIMIT:
            raise _bad("seed", rule, obj["seed"])
        kw["seed"] = s
    if obj.get("stop") is not None:
        stops = _as_stops(obj["stop"])
        if stops:
            kw["stop"] = stops
    return SamplingParams(**{**default.__dict__, **kw, "given": tuple(k for k in SAMPLING_KEYS if k in kw)})


NON_FINITE_LOGITS = "non-finite logits"  # the error's wording, which the stream guard's breaker reads


# -- the serving loop ---------------------------------------------------------------------------
class Sink(Protocol):
    def piece(self, text: str) -> None: ...
    def finish(self, text: str | None) -> None: ...
    def fail(self, message: str, code: str) -> None: ...
    def cancelled(self) -> bool: ...


def one_element(arr: np.ndarray, name: str) -> Any:
    flat = arr.reshape(-1)
    if flat.size != 1:
        raise InvalidInput(name, "shape [1]", f"expected one element, got shape {list(arr.shape)}")
    return flat[0]


def read_contract(inputs: Mapping[str, np.ndarray], *, max_prompt_chars: int,
                  limit_name: str = "max_prompt_chars") -> tuple[str, bool, bool | None, Any]:
    """The vLLM contract's inputs -> (prompt, stream, exclude_input_in_output or None when
    absent, the raw sampling_parameters or None); any rule broken raises InvalidInput naming the
    input. Shared by the generator and the guard in front of one (tritonguard.guard.stream)."""
    if "text_input" not in inputs:
        raise InvalidInput("text_input", "presence", "the input is required")
    raw = one_element(inputs["text_input"], "text_input")
    if isinstance(raw, bytes):
        try:
            prompt = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidInput("text_input", "UTF-8", f"invalid byte at offset {exc.start}") from None
    else:
        prompt = str(raw)
    if not prompt:
        raise InvalidInput("text_input", "non-empty", "the prompt is empty")
    if len(prompt) > max_prompt_chars:
        raise InvalidInput("text_input", f"at most {max_prompt_chars} characters ({limit_name})", f"got {len(prompt)}")
    stream = bool(one_element(inputs["stream"], "stream")) if "stream" in inputs else False
    exclude = (bool(one_element(inputs["exclude_input_in_output"], "exclude_input_in_output"))
               if "exclude_input_in_output" in inputs else None)
    if stream and exclude is False:
        # as the vLLM backend: a stream carries only new text
        raise InvalidInput("exclude_input_in_output", "false only without stream",
                           "streamed responses never repeat the prompt")
    sp = inputs.get("sampling_parameters")
    return prompt, stream, exclude, None if sp is None else one_element(sp, "sampling_parameters")
