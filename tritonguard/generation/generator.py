"""The ``generator`` Python-based backend: a decoupled text generator with the vLLM backend's I/O.

Inputs ``text_input`` (BYTES [1], UTF-8), optional ``stream`` (BOOL [1]), ``sampling_parameters``
(BYTES [1], a JSON object: ``max_tokens``, ``temperature``, ``top_p``, ``seed``) and
``exclude_input_in_output`` (BOOL [1]); output ``text_output`` (BYTES). With ``stream`` true
every generated character is one response and a flags-only COMPLETE_FINAL closes the stream;
otherwise one response carries the whole text (prefixed by the prompt unless
``exclude_input_in_output``, as vLLM does).

The artifact (see ``examples/generator.py``) is one recurrent step in ONNX with explicit state:
``TOKENS`` [B, T], ``STATE`` [1, B, H] -> ``LOGITS`` [B, V] (last position), ``STATE_OUT``.
``execute()`` only validates and enqueues; one decode thread per instance prefills new prompts
(one call each, T = prompt length) and advances every in-flight sequence with one batched call
per token. Row results of that call do not depend on which other rows share it (checked by the
unit tests on the shipped onnxruntime), so a seed fixes the text whatever else is in flight.
"""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from tritonguard.core import catalogue
from tritonguard.core.config import from_params, model_parameters
from tritonguard.core.errors import ConfigError, InvalidInput, TritonGuardError
from tritonguard.triton import backend as triton

log = logging.getLogger(__name__)

INPUTS = ("text_input", "stream", "sampling_parameters", "exclude_input_in_output")
OUTPUT = "text_output"
SAMPLING_KEYS = ("max_tokens", "temperature", "top_p", "seed")
SEED_LIMIT = 2**63


class CharTokenizer:
    """One token per character: EOS, UNK, newline, tab and printable ASCII.

    Other characters of a prompt become UNK (which is never generated), so ``decode(encode(s))
    == s`` exactly for text in the alphabet.
    """

    EOS, UNK = "<eos>", "<unk>"

    def __init__(self, chars: str | None = None) -> None:
        alphabet = chars if chars is not None else "\n\t" + "".join(chr(c) for c in range(32, 127))
        self.itos = [self.EOS, self.UNK, *alphabet]
        self.stoi = {c: i for i, c in enumerate(self.itos) if i >= 2}
        self.eos, self.unk = 0, 1

    @property
    def vocab_size(self) -> int:
        return len(self.itos)

    def encode(self, text: str) -> list[int]:
        unk, stoi = self.unk, self.stoi
        return [stoi.get(c, unk) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.itos[i] for i in ids if i >= 2)

    def piece(self, token: int) -> str:
        return self.itos[token] if token >= 2 else ""

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "char", "eos": self.EOS, "unk": self.UNK, "chars": "".join(self.itos[2:])}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CharTokenizer:
        if d.get("kind") != "char" or not isinstance(d.get("chars"), str):
            raise ValueError("vocab.json: expected {'kind': 'char', 'chars': '...'}")
        return cls(d["chars"])


# -- sampling parameters ------------------------------------------------------------------------
@dataclass(frozen=True)
class SamplingParams:
    """vLLM's defaults: 16 tokens, temperature 1, top_p 1, no seed (fresh entropy)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
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
    return SamplingParams(**{**default.__dict__, **kw, "given": tuple(k for k in SAMPLING_KEYS if k in kw)})


NON_FINITE_LOGITS = "non-finite logits"  # the error's wording, which the stream guard's breaker reads


def pick(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator, banned: int) -> int:
    """Next token from one row of logits: argmax at temperature 0, else nucleus sampling."""
    z = logits.astype(np.float64)
    z[banned] = -np.inf
    if params.greedy:
        return int(np.argmax(z))
    z = (z - z.max()) / params.temperature
    p = np.exp(z)
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    sorted_p = p[order]
    cum = np.cumsum(sorted_p)
    if params.top_p < 1.0:
        keep = int(np.searchsorted(cum, params.top_p)) + 1  # smallest prefix reaching top_p
        order, cum = order[:keep], cum[:keep]
    k = int(np.searchsorted(cum, rng.random() * cum[-1], side="right"))
    return int(order[min(k, len(order) - 1)])


# -- the step model and decoding ----------------------------------------------------------------
class StepModel:
    """The ONNX step: ``run(tokens [B, T], state [1, B, H]) -> (logits [B, V], state)``."""

    def __init__(self, path: Path, threads: int = 1) -> None:
        import onnxruntime as ort  # noqa: PLC0415

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        shape = {i.name: i.shape for i in self.session.get_inputs()}.get("STATE")
        if shape is None or not isinstance(shape[-1], int):
            raise ConfigError(f"{path}: expected an input STATE [layers, batch, hidden] with a fixed hidden size")
        self.layers = shape[0] if isinstance(shape[0], int) else 1
        self.hidden = shape[-1]

    def zeros(self, batch: int) -> np.ndarray:
        return np.zeros((self.layers, batch, self.hidden), np.float32)

    def run(self, tokens: np.ndarray, state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        logits, state = self.session.run(["LOGITS", "STATE_OUT"], {"TOKENS": tokens, "STATE": state})
        return logits, state


@dataclass
class Sequence:
    """One generation in flight."""

    prompt: str
    params: SamplingParams
    stream: bool = False
    prepend_prompt: bool = False
    sink: Any = None
    rng: np.random.Generator = field(default=None)  # type: ignore[assignment]
    pieces: list[str] = field(default_factory=list)
    logits: np.ndarray | None = None
    state: np.ndarray | None = None
    done: bool = False
    error: str | None = None  # why decoding stopped early (non-finite logits); the request fails
    last_cancel_check: float = 0.0
    received: float = field(default_factory=time.perf_counter)  # when execute() got the request
    first_token_at: float | None = None  # first token sent (stream) / decided (whole text)
    last_token_at: float = 0.0  # last streamed token sent
    ended: bool = False  # counted in the metrics (and answered)

    def __post_init__(self) -> None:
        if self.rng is None:
            seed = self.params.seed if self.params.seed is not None else int.from_bytes(os.urandom(8), "little")
            self.rng = np.random.default_rng(seed)

    @property
    def text(self) -> str:
        return "".join(self.pieces)


class Decoder:
    """Prefill and batched decode over :class:`Sequence` objects; no threads, no Triton."""

    def __init__(self, model: StepModel, tokenizer: CharTokenizer) -> None:
        self.model, self.tok = model, tokenizer

    def prefill(self, seq: Sequence) -> None:
        ids = np.array([[self.tok.eos, *self.tok.encode(seq.prompt)]], np.int64)
        seq.logits, seq.state = self.model.run(ids, self.model.zeros(1))
        seq.logits = seq.logits[0]

    def advance(self, seqs: list[Sequence]) -> list[tuple[Sequence, str | None]]:
        """Pick one token for each sequence; ``(seq, piece)`` with piece None when it ended
        (EOS or max_tokens). Runs one batched step for those that go on."""
        out: list[tuple[Sequence, str | None]] = []
        going: list[tuple[Sequence, int]] = []
        for seq in seqs:
            if not np.isfinite(seq.logits).all():  # type: ignore[arg-type]
                # a broken checkpoint: nothing sensible can be sampled from NaN/Inf, and argmax
                # would quietly pick token 0; this request fails, its neighbours go on
                seq.done = True
                seq.error = f"{NON_FINITE_LOGITS} after {len(seq.pieces)} tokens"
                out.append((seq, None))
                continue
            token = pick(seq.logits, seq.params, seq.rng, self.tok.unk)  # type: ignore[arg-type]
            if token == self.tok.eos:
                seq.done = True
                out.append((seq, None))
                continue
            piece = self.tok.piece(token)
            seq.pieces.append(piece)
            out.append((seq, piece))
            if len(seq.pieces) >= seq.params.max_tokens:
                seq.done = True
            else:
                going.append((seq, token))
        if going:
            tokens = np.array([[t] for _, t in going], np.int64)
            state = np.concatenate([s.state for s, _ in going], axis=1)  # type: ignore[misc]
            logits, state = self.model.run(tokens, state)
            for i, (s, _) in enumerate(going):
                s.logits, s.state = logits[i], state[:, i:i + 1]
        return out

    def generate_many(self, prompts: list[str], params: list[SamplingParams]) -> list[str]:
        """Several sequences decoded together, as the engine batches them (each prefilled alone,
        then advanced as one batch); a row's text does not depend on its neighbours."""
        seqs = [Sequence(p, q) for p, q in zip(prompts, params, strict=True)]
        for seq in seqs:
            self.prefill(seq)
        active = seqs
        while active:
            self.advance(active)
            active = [s for s in active if not s.done]
        return [s.text for s in seqs]

    def generate(self, prompt: str, params: SamplingParams) -> str:
        """One sequence alone, start to end (tests and offline use)."""
        seq = Sequence(prompt, params)
        self.prefill(seq)
        while not seq.done:
            self.advance([seq])
        if seq.error is not None:
            raise ValueError(seq.error)
        return seq.text


# -- metrics ------------------------------------------------------------------------------------


class MetricsSink(Protocol):
    """What the engine needs of :class:`tritonguard.triton.backend.Metrics` (in-process, no IPC)."""

    def inc(self, family: str, value: float = 1, **labels: str) -> None: ...
    def observe(self, family: str, value: float, **labels: str) -> None: ...


class NoMetrics:
    def inc(self, family: str, value: float = 1, **labels: str) -> None:
        pass

    def observe(self, family: str, value: float, **labels: str) -> None:
        pass


def generation_metrics(model: str, version: str) -> Any:
    return triton.Metrics(model, version, counters=catalogue.GENERATION_COUNTERS, gauges={},
                          histograms=catalogue.GENERATION_HISTOGRAMS, zero_at_load=catalogue.GENERATION_ZERO_AT_LOAD)


# -- the serving loop ---------------------------------------------------------------------------
class Sink(Protocol):
    def piece(self, text: str) -> None: ...
    def finish(self, text: str | None) -> None: ...
    def fail(self, message: str, code: str) -> None: ...
    def cancelled(self) -> bool: ...


class Engine:
    """One decode thread: admits queued sequences up to ``max_active``, prefills them, then
    advances all in flight by one token per loop; polls cancellation every ``cancel_poll_s``."""

    def __init__(self, decoder: Decoder, *, max_active: int = 16, max_queue: int = 256,
                 cancel_poll_s: float = 0.05, name: str = "generator",
                 metrics: MetricsSink | None = None, itl_per_token: bool = False) -> None:
        self.decoder = decoder
        # observations only go to the in-process sink (a deque the Metrics flusher empties)
        self.metrics: MetricsSink = metrics if metrics is not None else NoMetrics()
        self.itl_per_token = itl_per_token
        self.max_active, self.cancel_poll_s = max_active, cancel_poll_s
        self.queue: queue.Queue[Sequence] = queue.Queue(maxsize=max_queue)
        self.active: list[Sequence] = []
        self._stop = threading.Event()
        self.tokens = 0
        self._thread = threading.Thread(target=self._run, name=f"decode-{name}", daemon=True)
        self._thread.start()

    def submit(self, seq: Sequence) -> None:
        try:
            self.queue.put_nowait(seq)
        except queue.Full:
            self.metrics.inc("gen_requests", outcome="rejected")
            safe_send(seq.sink.fail, "the generator's queue is full; retry later", "UNAVAILABLE")

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout)
        pending = list(self.active)
        while True:
            try:
                pending.append(self.queue.get_nowait())
            except queue.Empty:
                break
        for seq in pending:
            if not seq.ended:
                self._ended(seq, "error")
                safe_send(seq.sink.fail, "the model is unloading", "UNAVAILABLE")

    def _ended(self, seq: Sequence, outcome: str) -> None:
        """Per-request accounting at its end (one inc per family, no per-token IPC)."""
        if seq.ended:
            return
        seq.ended = True
        m = self.metrics
        m.inc("gen_requests", outcome=outcome)
        if seq.pieces:
            m.inc("gen_tokens", len(seq.pieces), direction="out")
        if (seq.stream and not self.itl_per_token and seq.first_token_at is not None
                and len(seq.pieces) >= 2):
            m.observe("itl", (seq.last_token_at - seq.first_token_at) / (len(seq.pieces) - 1))

    def _admit(self) -> None:
        block = not self.active
        while len(self.active) < self.max_active:
            try:
                seq = self.queue.get(timeout=0.1) if block else self.queue.get_nowait()
            except queue.Empty:
                return
            block = False
            try:
                self.decoder.prefill(seq)
            except Exception as exc:  # noqa: BLE001 - one bad prompt must not stop the loop
                log.exception("prefill failed")
                self._ended(seq, "error")
                safe_send(seq.sink.fail, f"generation failed: {type(exc).__name__}", "INTERNAL")
                continue
            self.metrics.inc("gen_tokens", len(seq.prompt), direction="in")
            self.active.append(seq)

    def _cancelled(self, seq: Sequence, now: float) -> bool:
        # a Triton request's is_cancelled() is an IPC round trip: polled every cancel_poll_s. A
        # sink whose check is a flag read (the stream guard's in-process LocalStream) is read at
        # every step: 256 tinylm tokens take less than one 50 ms poll interval
        if not getattr(seq.sink, "cheap_cancel_check", False) and now - seq.last_cancel_check < self.cancel_poll_s:
            return False
        seq.last_cancel_check = now
        return bool(safe_send(seq.sink.cancelled))

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._admit()
                if not self.active:
                    continue
                now = time.monotonic()
                live = []
                for seq in self.active:
                    if self._cancelled(seq, now):
                        log.info("request cancelled after %d tokens: decoding stopped", len(seq.pieces))
                        self._ended(seq, "cancelled")
                        safe_send(seq.sink.fail, "the request was cancelled", "CANCELLED")
                    else:
                        live.append(seq)
                for seq, piece in self.decoder.advance(live):
                    if piece is not None:
                        self.tokens += 1
                        if seq.stream:
                            safe_send(seq.sink.piece, piece)
                        self._token_timing(seq)
                    if seq.done and seq.error is not None:
                        log.warning("generation stopped: %s", seq.error)
                        self._ended(seq, "error")
                        safe_send(seq.sink.fail, f"generation failed: the model produced {seq.error}", "INTERNAL")
                    elif seq.done:
                        text = None if seq.stream else (seq.prompt if seq.prepend_prompt else "") + seq.text
                        self._ended(seq, "ok")
                        safe_send(seq.sink.finish, text)
                self.active = [s for s in live if not s.done]
            except Exception:  # noqa: BLE001 - fail what is in flight, keep serving
                log.exception("decode step failed")
                for seq in self.active:
                    if not seq.ended:
                        self._ended(seq, "error")
                        safe_send(seq.sink.fail, "generation failed: internal error", "INTERNAL")
                self.active = []

    def _token_timing(self, seq: Sequence) -> None:
        """After a token was sent (stream) or decided (whole text): TTFT on the first, the gap
        since the previous one for streams (per token only with ``itl_per_token``)."""
        t = time.perf_counter()
        if seq.first_token_at is None:
            seq.first_token_at = t
            self.metrics.observe("ttft", t - seq.received)
        elif self.itl_per_token and seq.stream:
            self.metrics.observe("itl", t - seq.last_token_at)
        seq.last_token_at = t


def safe_send(fn: Callable[..., Any], *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001 - a client gone mid-stream is not the loop's problem
        log.warning("response to one request failed", exc_info=True)
        return None


# -- Triton ---------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class GeneratorConfig:
    """config.pbtxt ``parameters`` of a ``generator`` model."""

    max_tokens_cap: int = 256
    default_max_tokens: int = 16
    max_prompt_chars: int = 8192
    max_active: int = 16
    max_queue: int = 256
    intra_op_threads: int = 1
    cancel_poll_ms: int = 50
    # ITL: one observation per streamed token (one pb_utils IPC each in the flusher) instead of
    # one per request (its mean); see docs/generation.md "Metrics"
    itl_per_token: bool = False

    def __post_init__(self) -> None:
        for name in ("max_tokens_cap", "default_max_tokens", "max_prompt_chars", "max_active",
                     "max_queue", "intra_op_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"parameter '{name}' must be >= 1, got {getattr(self, name)}")
        if self.cancel_poll_ms < 0:
            raise ValueError(f"parameter 'cancel_poll_ms' must be >= 0, got {self.cancel_poll_ms}")


class TritonSink:
    """Responses of one decoupled request (the generator's, and the stream guard's to its
    client). ``finish(None)`` ends a stream with a flags-only final response; ``finish(text)``
    sends the text with the final flag (a non-streamed answer: exactly one response)."""

    def __init__(self, request: Any, sender: Any) -> None:
        self.request, self.sender = request, sender
        self.final = triton.pb().TRITONSERVER_RESPONSE_COMPLETE_FINAL
        self.closed = False  # a final response was sent

    def _text(self, text: str) -> Any:
        return triton.response({OUTPUT: np.array([text.encode("utf-8")], dtype=np.object_)})

    def piece(self, text: str) -> None:
        self.sender.send(self._text(text))

    def finish(self, text: str | None) -> None:
        self.closed = True
        if text is None:
            self.sender.send(flags=self.final)
        else:
            self.sender.send(self._text(text), flags=self.final)

    def fail(self, message: str, code: str) -> None:
        self.closed = True
        self.sender.send(triton.error(message, code), flags=self.final)

    def cancelled(self) -> bool:
        return bool(self.request.is_cancelled())


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


def parse_request(inputs: Mapping[str, np.ndarray], cfg: GeneratorConfig) -> Sequence:
    """The request's inputs -> a :class:`Sequence`; any rule broken raises InvalidInput."""
    prompt, stream, exclude, raw_sp = read_contract(inputs, max_prompt_chars=cfg.max_prompt_chars)
    params = parse_sampling(raw_sp, max_tokens_cap=cfg.max_tokens_cap, default_max_tokens=cfg.default_max_tokens)
    return Sequence(prompt, params, stream=stream, prepend_prompt=not stream if exclude is None else not exclude)


class GeneratorModel:
    def initialize(self, args: dict[str, str]) -> None:
        triton.setup_logging()
        cfg = triton.model_config(args)
        self.name = args["model_name"]
        if not (cfg.get("model_transaction_policy") or {}).get("decoupled"):
            raise ConfigError(f"model '{self.name}': backend 'generator' needs "
                              "model_transaction_policy { decoupled: true }")
        self.config = from_params(GeneratorConfig, model_parameters(cfg), model=self.name)
        version_dir = Path(args["model_repository"]) / args["model_version"]
        try:
            tok = CharTokenizer.from_dict(json.loads((version_dir / "vocab.json").read_text()))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"model '{self.name}': cannot read {version_dir / 'vocab.json'}: {exc}") from None
        model = StepModel(version_dir / "model.onnx", self.config.intra_op_threads)
        self.metrics = generation_metrics(self.name, args["model_version"])
        self.engine = Engine(Decoder(model, tok), max_active=self.config.max_active,
                             max_queue=self.config.max_queue,
                             cancel_poll_s=self.config.cancel_poll_ms / 1000, name=self.name,
                             metrics=self.metrics, itl_per_token=self.config.itl_per_token)
        log.info("generator %s v%s: vocab %d, hidden %d, max_tokens_cap %d", self.name,
                 args["model_version"], tok.vocab_size, model.hidden, self.config.max_tokens_cap)

    def execute(self, requests: list[Any]) -> None:
        received = time.perf_counter()
        for request in requests:
            sender = request.get_response_sender()
            sink = TritonSink(request, sender)
            try:
                seq = parse_request(triton.request_inputs(request, INPUTS), self.config)
            except TritonGuardError as exc:
                self.metrics.inc("gen_requests", outcome="rejected")
                safe_send(sink.fail, str(exc), exc.code)
                continue
            except Exception as exc:  # noqa: BLE001 - never let a traceback reach clients
                log.exception("generator %s: request rejected", self.name)
                self.metrics.inc("gen_requests", outcome="rejected")
                safe_send(sink.fail, f"model '{self.name}' cannot read the request: {type(exc).__name__}", "INTERNAL")
                continue
            seq.sink, seq.received = sink, received
            self.engine.submit(seq)
        return None

    def finalize(self) -> None:
        self.engine.stop()
        self.metrics.close()
