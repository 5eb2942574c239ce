"""Decoding a tinylm-style artifact: its character tokenizer, one recurrent step in ONNX with
explicit state, and a decoder that prefills prompts and advances many sequences with one batched
call per token. Row results of that call do not depend on which other rows share it, so a seed
fixes the text whatever else is in flight.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tritonguard.core.errors import ConfigError
from tritonguard.generation.contract import (
    NON_FINITE_LOGITS,
    SamplingParams,
    StopScanner,
    cut_at_stop,
)


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
    request_id: str = ""  # the Triton request's id (a caller's stop request names it)
    stopped: bool = False  # its caller asked to stop it (contract.STOP_PREFIX)
    # the streamed pieces on their way out, cut at the first stop sequence (sampling ``stop``)
    stops: StopScanner = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.rng is None:
            seed = self.params.seed if self.params.seed is not None else int.from_bytes(os.urandom(8), "little")
            self.rng = np.random.default_rng(seed)
        self.stops = StopScanner(self.params.stop)

    @property
    def text(self) -> str:
        """Every token generated (a stop sequence included)."""
        return "".join(self.pieces)

    @property
    def answer(self) -> str:
        """The answer: the text before the first stop sequence."""
        return cut_at_stop(self.text, self.params.stop)[0] if self.params.stop else self.text

    def reached_stop(self, piece: str) -> bool:
        """Whether the token ``piece`` just added completed a stop sequence."""
        stops = self.params.stop
        if not stops:
            return False
        need = len(piece) + max(len(s) for s in stops) - 1  # a stop ending in ``piece`` lies within
        tail: list[str] = []
        for p in reversed(self.pieces):  # the newest tokens only, not the whole text every step
            tail.append(p)
            need -= len(p)
            if need <= 0:
                break
        window = "".join(reversed(tail))
        return any(s in window for s in stops)


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
            if len(seq.pieces) >= seq.params.max_tokens or seq.reached_stop(piece):
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
        return [s.answer for s in seqs]

    def generate(self, prompt: str, params: SamplingParams) -> str:
        """One sequence alone, start to end (tests and offline use)."""
        seq = Sequence(prompt, params)
        self.prefill(seq)
        while not seq.done:
            self.advance([seq])
        if seq.error is not None:
            raise ValueError(seq.error)
        return seq.answer
