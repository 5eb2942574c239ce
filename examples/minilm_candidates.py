"""A genuine second checkpoint of ``minilm``: all-MiniLM-L6-v2 fine-tuned on text that ships offline.

:func:`finetuned` (``--source examples.minilm_candidates:finetuned``) has the public contract
of :func:`examples.minilm.build`: the same tokenizer (the package's folder), TEXT [N,1] BYTES
-> EMBEDDING [N,384] float32, L2-normalised, max_batch_size 64, task ``embedding``, the same
golden sentences, no evaluation set, ``judge`` left to the exporter (``task``: new weights).
Its encoder is the package's weights after a short fine-tune:

- data: the docstrings of a fixed list of Python standard-library modules (:data:`MODULES`:
  each module, its public classes and functions, their public methods; read with
  ``inspect``, nothing but the stdlib, no network). A pair is (:func:`query` of the object's
  qualified name, the docstring's summary paragraph), e.g. ("http cookiejar cookie jar add
  cookie header", "Add correct Cookie: header to request ..."): code search, a task the base
  model does moderately (:func:`docstring_pairs`). Whole modules are held out
  (:func:`held_out`: ``crc32(name) % 5 == 0``, 17 of 62), so held-out pairs are on topics the
  fine-tune never saw. The text is the running interpreter's stdlib: its version is part of
  the data version.
- objective: in-batch contrastive, MultipleNegativesRankingLoss (cross-entropy over the cosine
  similarities x :data:`SCALE` of each query with every summary of the batch), AdamW with
  weight decay, linear warm-up then decay, dropout on, all layers trained, texts truncated to
  :data:`TRAIN_MAX_LENGTH` tokens.
- seeded: the batch order and dropout come from ``seed`` (torch's global RNG is left as it
  was); with one torch thread count, repeated runs give bit-identical weights.

Figures (:func:`report`; Python 3.11.7, torch 2.13 CPU, 1 torch thread on a shared 2-core VM):

- the fine-tune, :data:`STEPS` = 40 steps of 32 pairs (about one epoch of the 1,255 training
  pairs), takes 64-67 s; training loss 0.99 -> 0.66.
- held-out top-1 retrieval (each query's summary among all 381 held-out summaries): base
  25.5 %, fine-tune 34.4 %. On a task it was not trained on, neighbouring prose sentences of
  one docstring (:func:`neighbour_pairs`, 285 held-out pairs): base 11.6 %, fine-tune 12.3 %.
- per-text cosine between base and fine-tuned embeddings, over the 1,127 held-out texts of
  both tasks and the 24 golden sentences: min 0.892, 1 % quantile 0.938, median 0.980; over
  the golden sentences alone: min 0.975, median 0.9945.
- exported as v2 after the base as v1, ``judge_offline(..., "minilm_raw", 1, 2, judge="task",
  task="embedding", output="EMBEDDING")``: INCONCLUSIVE on the 24 unlabelled goldens,
  disagreement 4.17 % (1 row; upper 16.68 %), cosine floor 0.9771.

(Neighbouring-sentence pairs were tried as the training task first: the base finds only ~10 %
of held-out neighbours and a fine-tune on them did not improve that, so they serve as the
second, untrained check instead.)

The fine-tuned weights are computed once per process and (steps, seed) (:func:`finetune`,
cached; :func:`train` runs every time); :func:`finetuned_spec` loads them into a fresh
:func:`examples.minilm.build` spec, so the spec's reference (the torch model, sentence by
sentence) is the fine-tuned model's.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import itertools
import math
import re
import sys
import time
import warnings
import zlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from exporter.build.sources.spec import ExportSpec

from . import minilm

if TYPE_CHECKING:
    import torch

# pure-Python stdlib modules with prose docstrings (ones missing from an interpreter are skipped)
MODULES = (
    "argparse", "asyncio.events", "asyncio.tasks", "calendar", "collections", "concurrent.futures._base",
    "configparser", "contextlib", "csv", "dataclasses", "datetime", "decimal", "difflib", "email.message",
    "enum", "fractions", "ftplib", "functools", "gettext", "gzip", "heapq", "http.client", "http.cookiejar",
    "imaplib", "inspect", "ipaddress", "json", "logging", "logging.handlers", "mailbox",
    "multiprocessing.pool", "optparse", "pathlib", "pdb", "pickle", "pkgutil", "platform", "poplib",
    "pprint", "queue", "random", "shutil", "smtplib", "socket", "socketserver", "statistics", "string",
    "subprocess", "tarfile", "tempfile", "textwrap", "threading", "tokenize", "traceback", "typing",
    "unittest.case", "urllib.parse", "urllib.request", "uuid", "wave", "xml.dom.minidom", "zipfile",
)
HELD_OUT_MOD = 5  # a module is held out when crc32(name) % HELD_OUT_MOD == 0

# the recipe
SEED = 0
STEPS = 40  # ~1 epoch
BROKEN_STEPS = 120  # the broken twin: 3 epochs of shuffled pairs (see broken())
BATCH = 32  # pairs per step: 31 in-batch negatives per anchor
LR = 2e-5
WARMUP = 0.1  # share of the steps with a linear warm-up, then linear decay to 0
WEIGHT_DECAY = 0.01
SCALE = 20.0  # sentence-transformers' MultipleNegativesRankingLoss default
TRAIN_MAX_LENGTH = 64
MIN_SUMMARY = 15  # characters: shorter summaries say too little
EVAL_BATCH = 64

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")

Pair = tuple[str, str]


# -- data -----------------------------------------------------------------------------------
def _sentences(doc: str) -> list[str]:
    """Prose sentences of a docstring: paragraphs without doctests, lists or field lists,
    split at sentence ends; 40..250 characters, capitalised, ending in a full stop, mostly
    letters (no code, tables or signatures)."""
    out = []
    for para in re.split(r"\n\s*\n", inspect.cleandoc(doc)):
        if ">>>" in para or para.lstrip().startswith(("-", "*", ":")):
            continue
        for s in _SENTENCE_END.split(" ".join(para.split())):
            if 40 <= len(s) <= 250 and s[0].isupper() and s.endswith(".") and \
                    sum(c.isalpha() for c in s) > 0.7 * len(s):
                out.append(s)
    return out


def _summary(doc: str) -> str:
    """A docstring's first paragraph, on one line."""
    return " ".join(re.split(r"\n\s*\n", inspect.cleandoc(doc))[0].split())


def query(qualified_name: str) -> str:
    """What a user would type for an object: ``http.cookiejar.CookieJar.add_cookie_header`` ->
    ``http cookiejar cookie jar add cookie header``."""
    return " ".join(re.sub(r"(?<=[a-z])(?=[A-Z])", " ", p).lower() for p in re.split(r"[._]", qualified_name) if p)


def _documented(module_name: str) -> list[tuple[str, str]]:
    """(qualified name, docstring) of the module, its public classes and functions defined
    there, and their public methods, in name order."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated modules and attributes (typing.io, ...)
        try:
            mod = importlib.import_module(module_name)
        except ImportError:
            return []
        items: list[tuple[str, object]] = [(module_name, mod)]
        for name, obj in sorted(vars(mod).items()):
            if name.startswith("_") or getattr(obj, "__module__", None) != mod.__name__:
                continue
            if inspect.isclass(obj) or inspect.isfunction(obj):
                items.append((f"{module_name}.{name}", obj))
            if inspect.isclass(obj):
                items += [(f"{module_name}.{name}.{m}", f) for m, f in sorted(vars(obj).items())
                          if not m.startswith("_") and inspect.isfunction(f)]
        return [(q, obj.__doc__) for q, obj in items if isinstance(obj.__doc__, str)]


def held_out(module_name: str) -> bool:
    return zlib.crc32(module_name.encode()) % HELD_OUT_MOD == 0


def _split(pairs_of: Callable[[str, str], list[Pair]]) -> tuple[tuple[Pair, ...], tuple[Pair, ...]]:
    """(training, held-out) pairs over MODULES, split by module; a pair whose second text was
    seen already is dropped (no duplicate targets: retrieval ties, false in-batch negatives)."""
    out: dict[bool, list[Pair]] = {False: [], True: []}
    seen: set[str] = set()
    for module_name in MODULES:
        for qualified_name, doc in _documented(module_name):
            for pair in pairs_of(qualified_name, doc):
                if pair[1] not in seen:
                    seen.add(pair[1])
                    out[held_out(module_name)].append(pair)
    return tuple(out[False]), tuple(out[True])


@functools.cache
def docstring_pairs() -> tuple[tuple[Pair, ...], tuple[Pair, ...]]:
    """The fine-tune's data, (training pairs, held-out pairs): (:func:`query` of an object's
    qualified name, its docstring's summary paragraph). Deterministic for an interpreter."""

    def pairs_of(qualified_name: str, doc: str) -> list[Pair]:
        summary = _summary(doc)
        return [(query(qualified_name), summary)] if len(summary) >= MIN_SUMMARY and ">>>" not in summary else []

    return _split(pairs_of)


@functools.cache
def neighbour_pairs() -> tuple[tuple[Pair, ...], tuple[Pair, ...]]:
    """A second task the fine-tune does not train on: two neighbouring prose sentences of one
    docstring (:func:`_sentences`), split by module like :func:`docstring_pairs`."""
    return _split(lambda _, doc: list(itertools.pairwise(_sentences(doc))))


def data_version() -> str:
    train, test = docstring_pairs()
    v = sys.version_info
    return (f"{minilm.data_version()} + python{v.major}.{v.minor}.{v.micro} stdlib docstrings "
            f"({len(MODULES)} modules; {len(train)} training / {len(test)} held-out name-summary pairs)")


def hyperparameters(steps: int = STEPS, seed: int = SEED) -> dict[str, object]:
    return {"objective": "MultipleNegativesRanking (in-batch contrastive)", "pairs": "(qualified-name query, docstring summary)",
            "seed": seed, "steps": steps, "batch": BATCH, "lr": LR, "warmup": WARMUP, "weight_decay": WEIGHT_DECAY,
            "scale": SCALE, "train_max_length": TRAIN_MAX_LENGTH, "base": minilm.PACKAGE}


# -- fine-tune ------------------------------------------------------------------------------
@functools.cache
def tokenizer():
    import os  # noqa: PLC0415

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer  # noqa: PLC0415

    return AutoTokenizer.from_pretrained(str(minilm.model_dir()))


def _encode(module: torch.nn.Module, texts: Sequence[str], max_length: int) -> torch.Tensor:
    enc = tokenizer()(list(texts), truncation=True, max_length=max_length, padding=True, return_tensors="pt")
    return module(enc["input_ids"], enc["attention_mask"])


def embed(module: torch.nn.Module, texts: Sequence[str], *, max_length: int = minilm.MAX_LENGTH) -> np.ndarray:
    """Embeddings [N,384] of ``texts`` by a minilm spec's module, in batches of EVAL_BATCH."""
    import torch  # noqa: PLC0415

    was_training = module.training
    module.eval()
    try:
        with torch.inference_mode():
            return np.concatenate([_encode(module, texts[i:i + EVAL_BATCH], max_length).numpy()
                                   for i in range(0, len(texts), EVAL_BATCH)])
    finally:
        module.train(was_training)


def retrieval_accuracy(module: torch.nn.Module, pairs: Sequence[Pair]) -> float:
    """Top-1 accuracy of finding each pair's second sentence among all pairs' second
    sentences, by cosine with its first sentence."""
    a = embed(module, [p[0] for p in pairs])
    b = embed(module, [p[1] for p in pairs])
    return float(np.mean((a @ b.T).argmax(axis=1) == np.arange(len(pairs))))


def train(steps: int = STEPS, seed: int = SEED, *, shuffled: bool = False,
          ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Fine-tune the base minilm encoder (see the module doc), every call: (state dict of the
    pooled encoder, training metrics). :func:`finetune` is the cached one. ``shuffled``: the
    same recipe on pairs whose summaries were shuffled (each query paired with another object's
    summary, by ``seed``): a broken fine-tune, trained as hard on data that teaches nothing."""
    import torch  # noqa: PLC0415

    from . import training  # noqa: PLC0415 - loads torch

    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    module = minilm.build().module
    pairs, _ = docstring_pairs()
    if shuffled:
        perm = np.random.default_rng(seed + 1).permutation(len(pairs))
        pairs = tuple((q, pairs[j][1]) for (q, _), j in zip(pairs, perm, strict=True))
    order = np.random.default_rng(seed)
    batches: list[np.ndarray] = []
    while len(batches) < steps:  # epochs of shuffled, full batches
        perm = order.permutation(len(pairs))
        batches += [perm[i:i + BATCH] for i in range(0, len(perm) - BATCH + 1, BATCH)]
    decay = [p for n, p in module.named_parameters() if not n.endswith("bias") and "LayerNorm" not in n]
    rest = [p for n, p in module.named_parameters() if n.endswith("bias") or "LayerNorm" in n]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY},
                             {"params": rest, "weight_decay": 0.0}], lr=LR)
    warm = max(1, math.ceil(WARMUP * steps))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else max(0.0, (steps - s) / max(1, steps - warm)))
    labels = torch.arange(BATCH)
    losses = []
    t0 = time.perf_counter()
    module.train()
    # dropout: seeded, and the caller's RNG untouched; on examples.training's pinned threads
    with torch.random.fork_rng(devices=[]), training.pinned_threads():
        torch.manual_seed(seed)
        for idx in batches[:steps]:
            a = _encode(module, [pairs[i][0] for i in idx], TRAIN_MAX_LENGTH)
            b = _encode(module, [pairs[i][1] for i in idx], TRAIN_MAX_LENGTH)
            loss = torch.nn.functional.cross_entropy(SCALE * a @ b.T, labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            losses.append(loss.item())
    module.eval()
    tail = losses[-max(1, steps // 5):]
    metrics = {"train_loss_first": losses[0], "train_loss_last": float(np.mean(tail)),
               "train_seconds": time.perf_counter() - t0, "train_pairs_seen": float(steps * BATCH)}
    state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    return state, metrics


@functools.lru_cache(maxsize=4)
def _finetune_cached(steps: int, seed: int, shuffled: bool) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    return train(steps, seed, shuffled=shuffled)


def finetune(steps: int = STEPS, seed: int = SEED, *, shuffled: bool = False,
             ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """:func:`train`, once per process and (steps, seed, shuffled). The state dict is shared:
    load it (``load_state_dict`` copies), do not change it."""
    return _finetune_cached(int(steps), int(seed), bool(shuffled))


def eval_pairs() -> tuple[np.ndarray, np.ndarray]:
    """The held-out name-summary pairs as an evaluation set: TEXT [N,1] queries and, as their
    labels, each query's own summary (scored as recall@10 over all held-out summaries)."""
    from exporter.build.sources.hf_folders import text_array  # noqa: PLC0415

    _, test = docstring_pairs()
    return text_array([q for q, _ in test]), np.array([d.encode() for _, d in test], dtype=object)


def with_eval_pairs(spec: ExportSpec) -> ExportSpec:
    queries, docs = eval_pairs()
    spec.eval_inputs, spec.eval_labels = {"TEXT": queries}, docs
    return spec


def finetuned_spec(steps: int = STEPS, seed: int = SEED, *, shuffled: bool = False) -> ExportSpec:
    """:func:`examples.minilm.build` with the fine-tuned weights (``steps`` steps, ``seed``)."""
    state, metrics = finetune(steps, seed, shuffled=shuffled)
    spec = minilm.build()
    spec.module.load_state_dict(state)  # the spec's reference runs this module: it follows
    spec.module.eval()
    spec.data_version = data_version() + (" (summaries shuffled)" if shuffled else "")
    spec.hyperparameters = {**hyperparameters(steps, seed), **({"shuffled_pairs": True} if shuffled else {})}
    spec.training_metrics = dict(metrics)
    return spec


def finetuned() -> ExportSpec:
    """The fine-tuned checkpoint (the recipe's defaults): an export source."""
    return finetuned_spec()


def base_with_eval() -> ExportSpec:
    """The base (:func:`examples.minilm.build`) with the held-out pairs as its evaluation set."""
    return with_eval_pairs(minilm.build())


def finetuned_with_eval() -> ExportSpec:
    """:func:`finetuned` with the held-out pairs as its evaluation set (recall@10 is judged)."""
    return with_eval_pairs(finetuned_spec())


def broken() -> ExportSpec:
    """The broken twin: the recipe on shuffled pairs (:func:`train`), for :data:`BROKEN_STEPS`
    (3 epochs). One epoch of shuffled pairs is not enough to break it: at 40 steps it still
    moved held-out recall@10 from 69.8 % to 73.2 % (the genuine fine-tune: 80.6 %), a domain
    adaptation of sorts, while 18.9 % of the held-out texts fell under a 0.90 cosine to the base;
    at 120 steps recall@10 is 63.5 %, top-1 21.8 % (base 25.5 %), the untrained neighbour task
    4.6 % (base 11.6 %), and 98.6 % of the texts are under 0.90 (median cosine 0.706)."""
    return finetuned_spec(BROKEN_STEPS, shuffled=True)


def broken_with_eval() -> ExportSpec:
    return with_eval_pairs(broken())


# -- figures --------------------------------------------------------------------------------
def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.einsum("ij,ij->i", a, b) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def report(steps: int = STEPS, seed: int = SEED, *, shuffled: bool = False) -> dict[str, float]:
    """Base vs fine-tune (``shuffled``: vs the broken twin): top-1 retrieval on the held-out
    pairs of the fine-tune's task and of the neighbouring-sentence task, recall@10 on the
    fine-tune's (what the rollout judge scores); the per-sentence cosine between the two models'
    embeddings over every held-out text of both tasks plus the golden sentences (``cosine_*``,
    ``under_0.90``: the share below the judge's default floor), and over the golden sentences
    alone (``golden_cosine_*``)."""
    from exporter.build.evaluate import recall_at_k  # noqa: PLC0415

    base = minilm.build().module
    tuned = finetuned_spec(steps, seed, shuffled=shuffled).module
    out: dict[str, float] = {}
    texts: dict[str, None] = {}
    for task, (_, test) in (("summary", docstring_pairs()), ("neighbour", neighbour_pairs())):
        out[f"{task}_heldout_pairs"] = float(len(test))
        out[f"{task}_retrieval_base"] = retrieval_accuracy(base, test)
        out[f"{task}_retrieval_finetuned"] = retrieval_accuracy(tuned, test)
        texts.update(dict.fromkeys(s for p in test for s in p))
    _, test = docstring_pairs()
    for who, mod in (("base", base), ("finetuned", tuned)):
        hits = recall_at_k(embed(mod, [p[0] for p in test]), embed(mod, [p[1] for p in test]))
        out[f"summary_recall10_{who}"] = float(hits.mean())
    texts.update(dict.fromkeys(minilm.SENTENCES))
    order = list(texts)
    cos = cosines(embed(base, order), embed(tuned, order))
    gold = cos[[order.index(s) for s in minilm.SENTENCES]]
    out.update({"texts": float(len(cos)), "cosine_min": float(cos.min()), "cosine_p01": float(np.quantile(cos, 0.01)),
                "cosine_median": float(np.median(cos)), "under_0.90": float((cos < 0.90).mean()),
                "golden_cosine_min": float(gold.min()), "golden_cosine_median": float(np.median(gold)),
                "train_seconds": finetune(steps, seed, shuffled=shuffled)[1]["train_seconds"]})
    return out


if __name__ == "__main__":  # python -m examples.minilm_candidates [steps] [shuffled]
    for key, value in report(int(sys.argv[1]) if len(sys.argv) > 1 else STEPS,
                             shuffled=len(sys.argv) > 2 and sys.argv[2] == "shuffled").items():
        sys.stdout.write(f"{key}: {value:.4f}\n")
