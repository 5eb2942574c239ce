"""A tiny character-level language model that speaks Triton's vLLM backend contract.

Trained in seconds on CPU, offline, on the docstrings of a fixed list of standard-library
modules; exported to ONNX as one GRU step with explicit state, so decoding costs O(1) per
token; served by the decoupled ``generator`` backend (:mod:`tritonguard.generator`)::

    python -m examples.generator --repository model_repository --name tinylm

writes ``<repository>/<name>/config.pbtxt`` and ``<name>/1/{model.onnx,vocab.json}`` (~1 MB).

The graph: ``TOKENS`` int64 [B, T] and ``STATE`` float32 [1, B, H] -> ``LOGITS`` float32 [B, V]
(of the last position) and ``STATE_OUT`` [1, B, H]. T = 1 is a decode step; the prompt is
prefilled with T = its length. Training is deterministic for a given seed, torch thread count
and Python version (the docstrings are the running interpreter's).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import logging
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from tritonguard.generator import CharTokenizer
from tritonguard.repository import write_config

log = logging.getLogger(__name__)

SEED = 0
THREADS = 2  # training results depend on torch's thread count: pinned for reproducibility
EMBED = 48
HIDDEN = 128
SEQ = 64
BATCH = 64
STEPS = 200
LR = 6e-3
MAX_TOKENS_CAP = 256

MODULES = (
    "argparse", "asyncio", "base64", "bisect", "collections", "contextlib", "copy", "csv",
    "dataclasses", "datetime", "decimal", "difflib", "email.message", "enum", "fractions",
    "functools", "glob", "gzip", "hashlib", "heapq", "http.client", "inspect", "io",
    "ipaddress", "itertools", "json", "logging", "operator", "os", "pathlib", "pickle",
    "queue", "random", "re", "shlex", "shutil", "socket", "statistics", "string",
    "subprocess", "tempfile", "textwrap", "threading", "typing", "unittest", "urllib.parse",
    "uuid", "zipfile",
)


def corpus(modules: tuple[str, ...] = MODULES) -> list[str]:
    """Docstrings of ``modules`` and of their public classes, functions and methods, in a fixed
    order; duplicates (inherited or re-exported objects) are kept once."""
    seen: set[str] = set()
    docs: list[str] = []

    def add(obj: object) -> None:
        doc = inspect.getdoc(obj)
        if doc and len(doc) >= 40 and doc not in seen:
            seen.add(doc)
            docs.append(doc)

    with warnings.catch_warnings():  # typing.io / typing.re warn when touched
        warnings.simplefilter("ignore", DeprecationWarning)
        for name in modules:
            _module_docs(importlib.import_module(name), add)
    return docs


def _module_docs(mod: Any, add: Callable[[object], None]) -> None:
    add(mod)
    for attr in sorted(vars(mod)):
        obj = getattr(mod, attr)
        if attr.startswith("_") or getattr(obj, "__module__", None) != mod.__name__:
            continue
        add(obj)
        if inspect.isclass(obj):
            for meth in sorted(vars(obj)):
                if not meth.startswith("_"):
                    add(getattr(obj, meth, None))


class CharGRU(nn.Module):
    """TOKENS [B, T], STATE [1, B, H] -> LOGITS of the last position [B, V], STATE_OUT."""

    def __init__(self, vocab: int, embed: int = EMBED, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.gru = nn.GRU(embed, hidden, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def sequence(self, tokens: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out, state = self.gru(self.embed(tokens), state)
        return self.head(out), state

    def forward(self, tokens: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits, state = self.sequence(tokens, state)
        return logits[:, -1, :], state


def train(seed: int = SEED, steps: int = STEPS) -> tuple[CharGRU, CharTokenizer, dict[str, float]]:
    """Train on :func:`corpus`; returns the model, its tokenizer and a few figures."""
    t0 = time.perf_counter()
    torch.set_num_threads(THREADS)
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    tok = CharTokenizer()
    docs = corpus()
    # every document starts after an EOS: at serving time the prompt is prefilled after one too
    stream = np.concatenate([np.array([tok.eos, *tok.encode(d)], dtype=np.int64) for d in docs] + [np.array([tok.eos])])
    data = torch.from_numpy(stream)
    model = CharGRU(tok.vocab_size)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    loss_fn = nn.CrossEntropyLoss()
    h0 = torch.zeros(1, BATCH, HIDDEN)
    losses = []
    model.train()
    for _ in range(steps):
        starts = torch.from_numpy(rng.integers(0, len(stream) - SEQ - 1, size=BATCH))
        idx = starts[:, None] + torch.arange(SEQ + 1)[None, :]
        window = data[idx]
        logits, _ = model.sequence(window[:, :-1], h0)
        loss = loss_fn(logits.reshape(-1, tok.vocab_size), window[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
    model.eval()
    figures = {"train_s": time.perf_counter() - t0, "corpus_chars": float(len(stream)),
               "documents": float(len(docs)), "final_loss": float(np.mean(losses[-10:]))}
    return model, tok, figures


def export_onnx(model: CharGRU, dest: Path) -> Path:
    tokens = torch.zeros(2, 3, dtype=torch.int64)
    state = torch.zeros(1, 2, model.gru.hidden_size)
    with warnings.catch_warnings():  # tracer chatter (GRU with batch_first) is not actionable
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model, (tokens, state), str(dest), input_names=["TOKENS", "STATE"],
            output_names=["LOGITS", "STATE_OUT"], opset_version=17, do_constant_folding=True,
            dynamo=False, dynamic_axes={"TOKENS": {0: "batch", 1: "time"}, "STATE": {1: "batch"},
                                        "LOGITS": {0: "batch"}, "STATE_OUT": {1: "batch"}})
    return dest


def triton_config(name: str, max_tokens_cap: int = MAX_TOKENS_CAP) -> dict:
    """The vLLM backend's I/O contract, decoupled, served by backend ``generator``."""
    return {
        "name": name,
        "backend": "generator",
        "max_batch_size": 0,
        "model_transaction_policy": {"decoupled": True},
        "input": [
            {"name": "text_input", "data_type": "TYPE_STRING", "dims": [1]},
            {"name": "stream", "data_type": "TYPE_BOOL", "dims": [1], "optional": True},
            {"name": "sampling_parameters", "data_type": "TYPE_STRING", "dims": [1], "optional": True},
            {"name": "exclude_input_in_output", "data_type": "TYPE_BOOL", "dims": [1], "optional": True},
        ],
        "output": [{"name": "text_output", "data_type": "TYPE_STRING", "dims": [-1]}],
        "instance_group": [{"count": 1, "kind": "KIND_CPU"}],
        "parameters": {"max_tokens_cap": {"string_value": str(max_tokens_cap)}},
    }


def build(repository: Path, name: str = "tinylm", *, seed: int = SEED, steps: int = STEPS,
          max_tokens_cap: int = MAX_TOKENS_CAP) -> dict[str, float]:
    """Train and write ``<repository>/<name>`` (config.pbtxt, 1/model.onnx, 1/vocab.json)."""
    model, tok, figures = train(seed, steps)
    version = Path(repository) / name / "1"
    version.mkdir(parents=True, exist_ok=True)
    export_onnx(model, version / "model.onnx")
    (version / "vocab.json").write_text(json.dumps(tok.to_dict(), indent=1))
    write_config(Path(repository) / name, triton_config(name, max_tokens_cap))
    figures["onnx_bytes"] = float((version / "model.onnx").stat().st_size)
    return figures


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m examples.generator", description=__doc__.split("\n\n")[0])
    ap.add_argument("--repository", type=Path, required=True)
    ap.add_argument("--name", default="tinylm")
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--max-tokens-cap", type=int, default=MAX_TOKENS_CAP)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    figures = build(args.repository, args.name, seed=args.seed, steps=args.steps,
                    max_tokens_cap=args.max_tokens_cap)
    log.info("wrote %s: %s", args.repository / args.name, json.dumps({k: round(v, 3) for k, v in figures.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
