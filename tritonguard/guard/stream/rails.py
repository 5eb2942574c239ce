"""Output rails that block: rules (words, regular expressions) and classifier models that stop an
answer, and the hold-back that keeps what they have not judged yet from the client.

Redaction rewrites an answer; a rail ends it. So that blocked text never reaches the client, the
guard holds back the newest tokens of a streamed answer (at most ``rails.holdback_tokens``) and
releases a token only once every rail has seen it in context:

- **word rules** (``rails.block_words``): the window holds only what may still grow into a listed
  word or phrase (the word being written, when some listed word starts with it); prose goes out
  at once, so the hold-back costs next to nothing in time to first token;
- **pattern rules** (``rails.pattern.<NAME>``): the window holds only what may still grow into a
  match, as for words: the ``regex`` package's partial matching (``partial=True``) tells where the
  text's end begins a match that the next tokens may complete (``how to`` of ``how to (build|make)
  a \\w+ bomb``; the digits of ``\\d{16}`` so far). A pattern that ``regex`` cannot compile (its
  syntax differs from ``re``'s in corners) has the whole window held, as before partial matching;
- **a classifier** (``rails.model``, any Triton model that scores text rows: BYTES ``[n, 1]`` in,
  FP32 ``[n, k]`` out, the last column the score of "block"): called through BLS on the prompt and
  on each full window of the answer (with ``context_chars`` of the text before it); a window goes
  out only after its call passed, so a stream's text leaves a window at a time.

A match of at most ``holdback_tokens`` tokens is caught before any of it was sent; a longer one is
only caught once its end arrives (what left before stays sent). A block raises :class:`Blocked`:
the forwarder stops the target (``TargetCalls.stop``) and ends the client's stream with
``finish_reason`` ``content_filter`` (or a Triton error naming the rail).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tritonguard.core.errors import TritonGuardError

log = logging.getLogger(__name__)

CONTENT_FILTER = "content_filter"  # the finish reason of a blocked answer (OpenAI's name)
MAX_HOLDBACK_TOKENS = 4096


class Blocked(TritonGuardError):
    """A rail blocked the prompt or the answer. ``rail`` names it (``rails.block_words``,
    ``rails.pattern.<NAME>``, or the classifier model's name)."""

    code = "INVALID_ARG"

    def __init__(self, rail: str, where: str, detail: str = "") -> None:
        self.rail, self.where = rail, where
        super().__init__(f"{CONTENT_FILTER}: the {where} was blocked by rail '{rail}'" + (f" ({detail})" if detail else ""))


@dataclass(kw_only=True)
class RailsConfig:
    """``rails.*`` of a decoupled guard."""

    DYNAMIC_PREFIXES = ("pattern",)

    # words or phrases (comma-separated; case-insensitive, whole words; spaces match any whitespace)
    block_words: tuple[str, ...] = ()
    # ``rails.pattern.WEAPONS = "how to (build|make) a \\w+ bomb"``: regular expressions (case-insensitive)
    pattern: dict[str, str] = field(default_factory=dict)
    holdback_tokens: int = 16  # the most tokens of an answer held back (a match longer than this may leak its start)
    model: str = ""  # a classifier called through BLS ("": none)
    model_input: str = "TEXT"  # its BYTES input [n, 1]
    model_output: str = "probabilities"  # its FP32 output [n, k]: the last column scores "block"
    threshold: float = 0.5  # a score at or over it blocks
    check_prompt: bool = True  # the classifier and the rules judge the prompt too (before the target)
    # the classifier judges the answer's windows (false: the prompt only, e.g. a prompt-injection
    # classifier; the rules always judge the answer)
    check_answer: bool = True
    context_chars: int = 256  # answer text already released that a check sees before the window
    # the classifier's call failed: true lets the answer through (logged), false blocks it
    fail_open: bool = False

    def __post_init__(self) -> None:
        words = []
        for w in self.block_words:
            w = " ".join(w.split())
            if not w:
                continue
            words.append(w)
        self.block_words = tuple(words)
        if not 0 <= self.holdback_tokens <= MAX_HOLDBACK_TOKENS:
            raise ValueError(f"parameter 'rails.holdback_tokens' must lie in 0..{MAX_HOLDBACK_TOKENS}, "
                             f"got {self.holdback_tokens}")
        if not 0 < self.threshold <= 1:
            raise ValueError(f"parameter 'rails.threshold' must lie in (0, 1], got {self.threshold}")
        if not 0 <= self.context_chars <= 8192:
            raise ValueError(f"parameter 'rails.context_chars' must lie in 0..8192, got {self.context_chars}")
        self.model = self.model.strip()
        for name in ("model_input", "model_output"):
            if not str(getattr(self, name)).strip():
                raise ValueError(f"parameter 'rails.{name}' must not be empty")
        for name, rx in self.pattern.items():
            key = f"rails.pattern.{name}"
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
                raise ValueError(f"parameter '{key}': the name must be letters, digits and '_'")
            try:
                compiled = re.compile(rx, re.IGNORECASE)
            except re.error as exc:
                raise ValueError(f"parameter '{key}': not a valid regular expression: {exc}") from None
            if compiled.search("") is not None:
                raise ValueError(f"parameter '{key}': the pattern matches the empty string")

    @property
    def active(self) -> bool:
        return bool(self.block_words or self.pattern or self.model)


class Rules:
    """The word and pattern rules, compiled into one regular expression."""

    def __init__(self, cfg: RailsConfig) -> None:
        self.words = [w.lower() for w in cfg.block_words]
        self.max_word = max((len(w) for w in self.words), default=0)
        self.names: dict[str, str] = {}
        branches = []
        if self.words:
            alts = "|".join(r"\s+".join(re.escape(part) for part in w.split()) for w in
                            sorted(self.words, key=len, reverse=True))
            branches.append(rf"(?P<tg_words>(?<!\w)(?:{alts})(?!\w))")
            self.names["tg_words"] = "rails.block_words"
        for k, (name, rx) in enumerate(cfg.pattern.items()):
            branches.append(f"(?P<tg_p{k}>{rx})")
            self.names[f"tg_p{k}"] = f"rails.pattern.{name}"
        self.regex = re.compile("|".join(branches), re.IGNORECASE) if branches else None
        # patterns: the ``regex`` package's compile of the same branches, for partial matching;
        # None without patterns (the word scan below suffices) or where it cannot compile them
        self.partial = _partial_regex(branches) if cfg.pattern else None
        self.fixed = bool(cfg.pattern) and self.partial is None  # the whole window is held

    def find(self, text: str, *, final: bool = True) -> str | None:
        """The rail that matches somewhere in ``text``, or None. Not ``final`` (a stream's text so
        far): a match that ends where the text ends is not one yet ("bomb" may grow into
        "bombastic", ``\\d+`` into more digits); the hold-back keeps it until the next token."""
        if self.regex is None:
            return None
        n = len(text)
        for m in self.regex.finditer(text):
            if final or m.end() < n:
                return next((rail for group, rail in self.names.items() if m.group(group) is not None), "rails")
        return None

    def pending(self, text: str) -> int:
        """Where the end of ``text`` may still grow into a listed word or phrase, or a pattern's
        match: the index from which it must be held (``len(text)`` when nothing may)."""
        n = len(text)
        if self.partial is not None:
            # the leftmost match that the next tokens may still make (partial: it reaches the end
            # of the text unfinished) or change (complete, ending at the end: "\d+" may grow);
            # a complete match before the end is a block, which find() reports first
            for m in self.partial.finditer(text, partial=True):
                if m.partial or m.end() == n:
                    return m.start()
            return n
        if not self.words:
            return n
        for m in self.regex.finditer(text) if self.regex is not None else ():
            if m.end() == n:  # a match so far, which the next token decides (see find)
                return m.start()
        for i in range(max(0, n - self.max_word), n):
            if not text[i].isalnum() and text[i] != "_":
                continue
            if i > 0 and (text[i - 1].isalnum() or text[i - 1] == "_"):
                continue  # not the start of a word
            tail = text[i:].lower()
            spaced = " ".join(tail.split()) + (" " if tail[-1:].isspace() else "")
            if any(w.startswith(spaced) for w in self.words):
                return i
        return n


def _partial_regex(branches: list[str]) -> Any:
    """The rules' branches compiled by the ``regex`` package (which can match partially), or None
    where it is missing or reads a pattern differently enough to refuse it (the caller then holds
    the whole window)."""
    try:
        import regex  # noqa: PLC0415 - a dependency of transformers; only pattern rules need it

        return regex.compile("|".join(branches), regex.IGNORECASE | regex.VERSION0)
    except Exception as exc:  # noqa: BLE001 - ImportError or regex.error: the window is held whole
        log.warning("rails: pattern rules hold the whole window (no partial matching: %s: %s)",
                    type(exc).__name__, exc)
        return None


Classify = Callable[[list[str]], list[float]]


def bls_classifier(cfg: RailsConfig) -> Classify:
    """``texts -> scores``: one (non-decoupled) BLS call of ``cfg.model`` with the texts as rows."""

    def classify(texts: list[str]) -> list[float]:
        from tritonguard.triton import backend  # noqa: PLC0415 - pb_utils exists only inside Triton

        p = backend.pb()
        data = np.array([[t.encode("utf-8")] for t in texts], dtype=np.object_)
        resp = p.InferenceRequest(model_name=cfg.model, inputs=[p.Tensor(cfg.model_input, data)],
                                  requested_output_names=[cfg.model_output]).exec()
        if resp.has_error():
            raise RuntimeError(resp.error().message())
        out = p.get_output_tensor_by_name(resp, cfg.model_output)
        if out is None:
            raise RuntimeError(f"no output '{cfg.model_output}'")
        scores = np.asarray(out.as_numpy(), dtype=np.float64).reshape(len(texts), -1)[:, -1]
        return [float(s) for s in scores]

    return classify


class Rails:
    """One guard's rails: its rules and classifier, and the judging of a prompt or a text."""

    def __init__(self, cfg: RailsConfig, classify: Classify | None = None, *, name: str = "?",
                 metrics: Any = None) -> None:
        self.cfg, self.name, self.metrics = cfg, name, metrics
        self.rules = Rules(cfg)
        self.classify = classify if cfg.model else None
        self.answer_model = self.classify is not None and cfg.check_answer  # windows go to the classifier
        self._warned = 0.0

    @property
    def active(self) -> bool:
        return self.cfg.active

    def judge(self, text: str, where: str, *, classify: bool = True, final: bool = True) -> None:
        """Raise :class:`Blocked` when a rule matches ``text`` (see :meth:`Rules.find` for
        ``final``) or the classifier flags it."""
        rail = self.rules.find(text, final=final)
        if rail is not None:
            raise Blocked(rail, where)
        if classify and self.classify is not None and text:
            try:
                score = self.classify([text])[0]
            except Exception as exc:  # noqa: BLE001 - a failed call is the rail's verdict per fail_open
                now = time.monotonic()
                if now - self._warned > 60:
                    self._warned = now
                    log.warning("stream guard %s: rail model '%s' failed (%s); %s", self.name, self.cfg.model,
                                exc, "letting text through (rails.fail_open)" if self.cfg.fail_open else "blocking")
                if self.cfg.fail_open:
                    return
                raise Blocked(self.cfg.model, where, "the rail model could not judge it") from None
            if not np.isfinite(score) or score >= self.cfg.threshold:
                raise Blocked(self.cfg.model, where, f"score {score:.2f}")

    def prompt(self, prompt: str) -> None:
        if self.cfg.check_prompt:
            self.judge(prompt, "prompt")

    def holdback(self) -> HoldBack:
        return HoldBack(self)


class HoldBack:
    """One streamed answer's hold-back (see the module doc). :meth:`feed` takes the target's next
    tokens and returns the text that may go to the client now; :meth:`finish` the rest at the
    end. Both raise :class:`Blocked`; nothing held is released after that."""

    def __init__(self, rails: Rails) -> None:
        self.rails = rails
        self.window = rails.cfg.holdback_tokens
        self.context = rails.cfg.context_chars
        self.held: list[str] = []
        self.tail = ""  # the last ``context`` characters released
        self.tokens = 0  # tokens fed
        self.released = 0  # tokens released
        self.approved = 0  # the oldest held tokens the classifier passed

    def _release(self, n: int) -> str:
        if n <= 0:
            return ""
        out = "".join(self.held[:n])
        del self.held[:n]
        self.released += n
        self.approved = max(0, self.approved - n)
        if self.context:
            self.tail = (self.tail + out)[-self.context:]
        return out

    def _rules_keep(self, view: str) -> int:
        """How many of the newest held tokens the rules still need: only those that may still
        grow into a listed word or a pattern's match (the whole window where patterns cannot be
        matched partially)."""
        keep = min(self.window, len(self.held))
        if keep and not self.rails.rules.fixed:
            chars = len(view) - self.rails.rules.pending(view)
            k, covered = 0, 0
            while covered < chars and k < keep:
                k += 1
                covered += len(self.held[-k])
            keep = k
        return keep

    def feed(self, tokens: list[str]) -> str:
        if not tokens:
            return ""
        self.held.extend(tokens)
        self.tokens += len(tokens)
        rails = self.rails
        view = self.tail + "".join(self.held)
        rails.judge(view, "answer", classify=False, final=False)
        upto = len(self.held) - self._rules_keep(view)
        if rails.answer_model:
            # the classifier judges a full window of tokens it has not seen (with what is held
            # before it and ``context_chars`` of the released text); only what it passed goes out
            if len(self.held) - self.approved >= max(self.window, 1):
                rails.judge(view, "answer", final=False)
                self.approved = len(self.held)
            upto = min(upto, self.approved)
        return self._release(upto)

    def finish(self) -> str:
        """The answer ended: what is still held, once judged (the classifier sees the last,
        partial window when it has not passed it yet)."""
        if not self.held:
            return ""
        view = self.tail + "".join(self.held)
        self.rails.judge(view, "answer", classify=self.rails.answer_model and self.approved < len(self.held))
        return self._release(len(self.held))


def finish_reason_output(outputs: Mapping[str, Any] | list[dict[str, Any]]) -> bool:
    """Whether a guard's config.pbtxt declares the optional output ``finish_reason``."""
    names = [o.get("name") for o in outputs] if isinstance(outputs, list) else list(outputs)
    return "finish_reason" in names
