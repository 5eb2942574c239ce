"""A tiny character-level language model that speaks Triton's vLLM backend contract.

Trained in seconds on CPU, offline, on the docstrings of a fixed list of standard-library
modules; exported to ONNX as one GRU step with explicit state, so decoding costs O(1) per
token; served by the decoupled ``generator`` backend (:mod:`tritonguard.generation.generator`)::

    python -m examples.generator --repository model_repository --name tinylm --version 1

writes ``<repository>/<name>/config.pbtxt`` and ``<name>/<version>/`` with ``model.onnx``,
``vocab.json``, ``eval.json`` (held-out documents), ``goldens.json`` (greedy and seeded
decodes of the exported file) and ``manifest.json`` (sha256, training figures, golden verdict,
bits per char on the eval texts, and the judge a rollout applies: ``equivalence`` when another
version holds the same bytes, else ``task``). ``--guard NAME`` also writes a decoupled stream
guard in front of it.

The graph: ``TOKENS`` int64 [B, T] and ``STATE`` float32 [1, B, H] -> ``LOGITS`` float32 [B, V]
(of the last position) and ``STATE_OUT`` [1, B, H]. T = 1 is a decode step; the prompt is
prefilled with T = its length. Training is deterministic for a given seed, torch thread count
and Python version (the docstrings are the running interpreter's), and so is the exported file.
"""

from __future__ import annotations

import argparse
import copy
import functools
import hashlib
import importlib
import inspect
import io
import json
import logging
import math
import os
import subprocess
import sys
import time
import warnings
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from examples import training
from tritonguard.core import repository as repo_mod
from tritonguard.core.files import atomic_write
from tritonguard.core.repository import write_config
from tritonguard.generation.contract import parse_sampling
from tritonguard.generation.decoder import CharTokenizer, Decoder, StepModel

log = logging.getLogger(__name__)

SEED = 0
EMBED = 48
HIDDEN = 128
SEQ = 64
BATCH = 64
STEPS = 200
LR = 6e-3
MAX_TOKENS_CAP = 256

# the held-out split: a document is evaluation data when its SHA-1 is 0 modulo EVAL_MODULUS,
# whatever the seed or steps, so every version of a model is scored on the same texts
EVAL_MODULUS = 10
EVAL_CHARS = 240  # each eval text is its document's first 240 characters
EVAL_MAX_TEXTS = 120
GOLDEN_TOKENS = 48
GREEDY_PROMPTS = ("Return the", "Create a new", "If the", "This module", "The default", "Raise",
                  "A list of", "Open the")
SAMPLED_PROMPTS = ("Return the", "The default", "A list of", "Open the")  # seeds 0..3
SAMPLED = {"temperature": 0.8, "top_p": 0.95}
FORMAT_VERSION = 1
EVAL_FILE, GOLDENS_FILE, VOCAB_FILE, ARTIFACT = "eval.json", "goldens.json", "vocab.json", "model.onnx"

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
    return list(_corpus(modules))


@functools.lru_cache(maxsize=4)
def _corpus(modules: tuple[str, ...]) -> tuple[str, ...]:
    """Collected in a fresh interpreter that has imported this module and nothing else: what a
    module's namespace holds depends on what the process imported before (``import ray`` changes
    one of these modules, and the corpus lost a document), so a model trained in a test process
    that had run Ray first greedily answered "are the" where a fresh one answers "an" (the
    suite's lanes, 2026-11-28). Every process now trains on the documents a fresh one sees
    after importing this module (torch and numpy included: they touch these modules too)."""
    root = Path(__file__).resolve().parents[1]
    code = "import json, sys\nfrom examples.generator import _collect_docs\nprint(json.dumps(_collect_docs(sys.argv[1:])))\n"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)}
    out = subprocess.run([sys.executable, "-c", code, *modules], capture_output=True, text=True, check=True,
                         cwd=root, env=env)
    return tuple(json.loads(out.stdout))


def _collect_docs(modules: Sequence[str]) -> list[str]:
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
            mod = importlib.import_module(name)
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
    return docs


def _doc_hash(doc: str) -> int:
    return int(hashlib.sha1(doc.encode("utf-8")).hexdigest(), 16)


def held_out(doc: str) -> bool:
    """Whether ``doc`` belongs to the evaluation split (never trained on, by any version)."""
    return _doc_hash(doc) % EVAL_MODULUS == 0


def split(docs: Sequence[str]) -> tuple[list[str], list[str]]:
    """(training documents in corpus order, held-out documents)."""
    train_docs = [d for d in docs if not held_out(d)]
    eval_docs = [d for d in docs if held_out(d)]
    return train_docs, eval_docs


def eval_texts(docs: Sequence[str] | None = None) -> list[str]:
    """The evaluation texts: held-out documents ordered by their SHA-1 (a fixed order that mixes
    the modules), each cut to its first :data:`EVAL_CHARS` characters, at most
    :data:`EVAL_MAX_TEXTS` of them."""
    _, held = split(corpus() if docs is None else docs)
    return [d[:EVAL_CHARS] for d in sorted(held, key=_doc_hash)[:EVAL_MAX_TEXTS]]


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


_TRAINED: dict[tuple[int, int], tuple[CharGRU, CharTokenizer, dict[str, float]]] = {}


def train(seed: int = SEED, steps: int = STEPS) -> tuple[CharGRU, CharTokenizer, dict[str, float]]:
    """Train on the training split of :func:`corpus` (the held-out documents never); returns
    the model, its tokenizer and a few figures. Training is deterministic for a seed and a
    number of steps, so a second call with the same ones in this process (a re-export of the
    same weights) gets a copy of the first result instead of training again."""
    if (seed, steps) in _TRAINED:
        model, tok, figures = _TRAINED[(seed, steps)]
        return copy.deepcopy(model), tok, dict(figures)
    cache = training.cache_folder()
    model, tok, figures = _train_shared(cache, seed, steps) if cache else _train(seed, steps)
    _TRAINED[(seed, steps)] = (copy.deepcopy(model), tok, dict(figures))
    return model, tok, figures


def _train_shared(folder: Path, seed: int, steps: int) -> tuple[CharGRU, CharTokenizer, dict[str, float]]:
    """:func:`_train`, once for every process that names the same ``folder`` in
    ``$TRITONGUARD_TRAIN_CACHE`` (:func:`examples.training.shared`); the key holds the seed, the
    steps and this file (the corpus is read by it from the running interpreter's modules)."""

    def load(saved: dict[str, Any]) -> tuple[CharGRU, CharTokenizer, dict[str, float]]:
        tok = CharTokenizer()
        model = CharGRU(tok.vocab_size)
        model.load_state_dict(saved["state"])
        model.eval()
        return model, tok, {k: float(v) for k, v in saved["figures"].items()}

    return training.shared(folder, "tinylm", training.cache_key(Path(__file__), seed, steps),
                           lambda: _train(seed, steps),
                           lambda r: {"state": r[0].state_dict(), "figures": r[2]}, load)


@training.pinned_threads()  # the result depends on torch's thread count; the caller's is restored
def _train(seed: int, steps: int) -> tuple[CharGRU, CharTokenizer, dict[str, float]]:
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    tok = CharTokenizer()
    docs, _ = split(corpus())
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


def export_onnx(model: CharGRU, dest: Path | None = None) -> bytes:
    """The ONNX step as bytes (also written atomically to ``dest`` when given). The same weights
    give the same bytes: the exporter names nodes and initializers deterministically."""
    tokens = torch.zeros(2, 3, dtype=torch.int64)
    state = torch.zeros(1, 2, model.gru.hidden_size)
    buf = io.BytesIO()
    with warnings.catch_warnings():  # tracer chatter (GRU with batch_first) is not actionable
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model, (tokens, state), buf, input_names=["TOKENS", "STATE"],
            output_names=["LOGITS", "STATE_OUT"], opset_version=17, do_constant_folding=True,
            dynamo=False, dynamic_axes={"TOKENS": {0: "batch", 1: "time"}, "STATE": {1: "batch"},
                                        "LOGITS": {0: "batch"}, "STATE_OUT": {1: "batch"}})
    data = buf.getvalue()
    if dest is not None:
        atomic_write(dest, data)
    return data


# -- what a version is judged on -----------------------------------------------------------------
def decoder(onnx_path: Path, tokenizer: CharTokenizer | None = None) -> Decoder:
    """The ``generator`` backend's own decoder on ``onnx_path`` (same session options, same
    sampling code): what it generates offline is what the served model answers."""
    return Decoder(StepModel(Path(onnx_path)), tokenizer or CharTokenizer())


def golden_cases() -> list[dict[str, Any]]:
    """Prompts and sampling parameters of the goldens (no text): 8 greedy, 4 seeded."""
    cases = [{"prompt": p, "sampling": {"max_tokens": GOLDEN_TOKENS, "temperature": 0}} for p in GREEDY_PROMPTS]
    cases += [{"prompt": p, "sampling": {"max_tokens": GOLDEN_TOKENS, **SAMPLED, "seed": k}}
              for k, p in enumerate(SAMPLED_PROMPTS)]
    return cases


def generate_case(dec: Decoder, case: dict[str, Any], max_tokens_cap: int = MAX_TOKENS_CAP) -> str:
    """The continuation (without the prompt) the served model answers for ``case`` with
    ``exclude_input_in_output: true``: its sampling JSON goes through the backend's parser."""
    params = parse_sampling(json.dumps(case["sampling"]), max_tokens_cap=max_tokens_cap)
    return dec.generate(case["prompt"], params)


def goldens(onnx_path: Path, tokenizer: CharTokenizer | None = None) -> list[dict[str, Any]]:
    dec = decoder(onnx_path, tokenizer)
    return [{**case, "text": generate_case(dec, case)} for case in golden_cases()]


def bits_per_char(onnx_path: Path | str, texts: Sequence[str], tokenizer: CharTokenizer | None = None) -> tuple[float, int]:
    """Teacher-forced mean negative log2-likelihood of the characters of ``texts`` (each read
    after an EOS, as in training) under the ONNX step at ``onnx_path``; (bits per char, chars
    scored). All texts run as one batch, one ONNX call per character position; positions past a
    text's end are padding, masked out of the sum."""
    tok = tokenizer or CharTokenizer()
    ids = [tok.encode(t) for t in texts]
    n = sum(len(i) for i in ids)
    if not n:
        raise ValueError("bits_per_char needs at least one non-empty text")
    model = StepModel(Path(onnx_path))
    width = max(len(i) for i in ids)
    tokens = np.full((len(ids), width + 1), tok.eos, np.int64)  # column 0: the EOS every text follows
    mask = np.zeros((len(ids), width), bool)
    for row, i in enumerate(ids):
        tokens[row, 1:len(i) + 1] = i
        mask[row, :len(i)] = True
    state = model.zeros(len(ids))
    total = 0.0
    rows = np.arange(len(ids))
    for pos in range(width):
        live = mask[:, pos]
        logits, state = model.run(tokens[:, pos:pos + 1], state)
        z = logits.astype(np.float64)
        z -= z.max(axis=1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))  # natural log-softmax
        total -= float(logp[rows[live], tokens[live, pos + 1]].sum())
    return total / n / math.log(2), n


# -- configs -------------------------------------------------------------------------------------
IO_INPUTS = [
    {"name": "text_input", "data_type": "TYPE_STRING", "dims": [1]},
    {"name": "stream", "data_type": "TYPE_BOOL", "dims": [1], "optional": True},
    {"name": "sampling_parameters", "data_type": "TYPE_STRING", "dims": [1], "optional": True},
    {"name": "exclude_input_in_output", "data_type": "TYPE_BOOL", "dims": [1], "optional": True},
]
IO_OUTPUTS = [{"name": "text_output", "data_type": "TYPE_STRING", "dims": [-1]}]


def triton_config(name: str, max_tokens_cap: int = MAX_TOKENS_CAP) -> dict:
    """The vLLM backend's I/O contract, decoupled, served by backend ``generator``; every version
    folder is loaded (``version_policy { all {} }``) so a rollout can route to several at once."""
    return {
        "name": name,
        "backend": "generator",
        "max_batch_size": 0,
        "model_transaction_policy": {"decoupled": True},
        "version_policy": {"all": {}},
        "input": [dict(i) for i in IO_INPUTS],
        "output": [dict(o) for o in IO_OUTPUTS],
        "instance_group": [{"count": 1, "kind": "KIND_CPU"}],
        "parameters": {"max_tokens_cap": {"string_value": str(max_tokens_cap)}},
    }


def stream_guard_config(guard: str, target: str, **parameters: Any) -> dict:
    """A decoupled stream guard (backend ``guard``) named ``guard`` in front of the generator
    ``target``, with the same inputs and outputs. ``parameters`` are the guard's keys with
    ``__`` for ``.`` (``validation__max_tokens="512"`` -> ``validation.max_tokens``)."""
    params = {"target": target, **{k.replace("__", "."): v for k, v in parameters.items()}}
    return {
        "name": guard,
        "backend": "guard",
        "max_batch_size": 0,
        "model_transaction_policy": {"decoupled": True},
        "input": [dict(i) for i in IO_INPUTS],
        "output": [dict(o) for o in IO_OUTPUTS],
        "instance_group": [{"count": 1, "kind": "KIND_CPU"}],
        "parameters": {k: {"string_value": str(v)} for k, v in params.items()},
    }


def _json(obj: Any) -> str:
    return json.dumps(obj, indent=1, ensure_ascii=False) + "\n"


def build(repository: Path, name: str = "tinylm", *, seed: int = SEED, steps: int = STEPS, version: int = 1,
          max_tokens_cap: int = MAX_TOKENS_CAP, guard: str | None = None) -> dict[str, float]:
    """Train and write ``<repository>/<name>/config.pbtxt`` and ``<name>/<version>/`` (model.onnx,
    vocab.json, eval.json, goldens.json, manifest.json last); with ``guard`` also
    ``<repository>/<guard>/config.pbtxt`` and an empty ``<guard>/1/``. Returns a few figures."""
    if version < 1:
        raise ValueError(f"version must be >= 1, got {version}")
    t0 = time.perf_counter()
    repository = Path(repository)
    model, tok, figures = train(seed, steps)
    model_dir = repository / name
    folder = model_dir / str(version)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / repo_mod.MANIFEST).unlink(missing_ok=True)  # a folder without a manifest is incomplete
    onnx = export_onnx(model, folder / ARTIFACT)
    sha = hashlib.sha256(onnx).hexdigest()
    atomic_write(folder / VOCAB_FILE, json.dumps(tok.to_dict(), indent=1))
    texts = eval_texts()
    eval_bytes = _json({"format_version": FORMAT_VERSION, "texts": texts}).encode("utf-8")
    atomic_write(folder / EVAL_FILE, eval_bytes)
    cases = goldens(folder / ARTIFACT, tok)
    again = goldens(folder / ARTIFACT, tok)  # a second session: decoding must be deterministic
    exact = sum(a["text"] == b["text"] for a, b in zip(cases, again, strict=True)) / len(cases)
    atomic_write(folder / GOLDENS_FILE, _json({"format_version": FORMAT_VERSION, "cases": cases}))
    t_eval = time.perf_counter()
    bpc, n_chars = bits_per_char(folder / ARTIFACT, texts, tok)
    figures["bpc_s"] = time.perf_counter() - t_eval
    same = repo_mod.version_with_artifact(model_dir, sha, exclude=version)
    manifest = {
        "format_version": FORMAT_VERSION, "name": name, "version": version, "artifact": ARTIFACT,
        "sha256": sha, "task": "generation", "source": "examples.generator:build",
        "created": datetime.now(timezone.utc).replace(microsecond=0).isoformat(), "format": "onnx",
        "training": {"seed": seed, "steps": steps, "final_loss": figures["final_loss"],
                     "train_s": round(figures["train_s"], 3), "corpus_chars": int(figures["corpus_chars"]),
                     "documents": int(figures["documents"])},
        "golden": {"verdict": "PASS" if exact == 1.0 else "FAIL", "n": len(cases), "metrics": {"exact": exact}},
        "evaluation": {"metric": "bits_per_char", "value": bpc, "n": n_chars, "docs": len(texts),
                       "sha256": hashlib.sha256(eval_bytes).hexdigest()},
        "judge": "equivalence" if same is not None else "task",
    }
    if same is not None:
        manifest["equivalent_to"] = same
    atomic_write(folder / repo_mod.MANIFEST, _json(manifest))
    write_config(model_dir, triton_config(name, max_tokens_cap))
    if guard:
        write_config(repository / guard, stream_guard_config(guard, name, validation__max_tokens=max_tokens_cap))
        repo_mod.write_placeholder(repository / guard / "1", guard)
    if exact != 1.0:
        raise RuntimeError(f"{folder}: decoding the exported model twice gave different goldens "
                           f"(exact {exact:.2f}); the manifest says FAIL")
    figures.update(onnx_bytes=float(len(onnx)), bits_per_char=bpc, build_s=time.perf_counter() - t0)
    return figures


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m examples.generator", description=__doc__.split("\n\n")[0])
    ap.add_argument("--repository", type=Path, required=True)
    ap.add_argument("--name", default="tinylm")
    ap.add_argument("--version", type=int, default=1, help="version folder to write (default 1)")
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--max-tokens-cap", type=int, default=MAX_TOKENS_CAP)
    ap.add_argument("--guard", metavar="NAME", help="also write a decoupled stream guard NAME in front of the model")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    figures = build(args.repository, args.name, seed=args.seed, steps=args.steps, version=args.version,
                    max_tokens_cap=args.max_tokens_cap, guard=args.guard)
    manifest = repo_mod.read_manifest(args.repository / args.name / str(args.version)) or {}
    log.info("wrote %s (judge %s, sha256 %s): %s", args.repository / args.name / str(args.version),
             manifest.get("judge"), str(manifest.get("sha256", ""))[:12],
             json.dumps({k: round(v, 3) for k, v in figures.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
