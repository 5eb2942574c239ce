"""Hugging Face sources: a local model folder (``config.json`` + tokenizer, loaded offline)
exported behind its tokenizer, as a sequence classifier (``*ForSequenceClassification``) or
else a sentence encoder (pooling as its sentence-transformers files say); and the golden
sentences of text models (built in, or read from ``--inputs``).
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from exporter.build.sources.files import read_npz, split_npz
from exporter.build.sources.spec import (
    TASKS,
    ExportSpec,
    SourceError,
    TensorDef,
    TextFront,
    first_line,
)

if TYPE_CHECKING:  # torch is heavy: import it where a module is actually built or run
    import torch
HF_CONFIG = "config.json"
HF_MAX_LENGTH = 512  # cap for models that state no limit of their own

# golden sentences for text models: varied lengths and scripts, so padding, truncation and
# multi-byte text all get exercised
GOLDEN_SENTENCES = [
    "Hello world.",
    "The cat sits on the mat.",
    "A man is playing a guitar on stage.",
    "Triton serves models over HTTP and gRPC.",
    "How do I reset my password?",
    "The quick brown fox jumps over the lazy dog.",
    "Embeddings map sentences to points in a vector space where similar meanings lie close together.",
    "ok",
    "Stock markets fell sharply after the central bank raised interest rates by half a point.",
    "Das Wetter ist heute schön.",
    "Le chat dort sur le canapé.",
    "東京は日本の首都です。",
    "Please return the package within 30 days for a full refund, including the original receipt.",
    "42",
    "What is the capital of France?",
    "Paris is the capital and most populous city of France.",
    "She sells sea shells by the sea shore.",
    "Gradient descent updates the parameters in the direction that reduces the loss.",
    "I love this product! Five stars.",
    "Terrible service, would not recommend.",
    "The meeting has been moved to Thursday at 3 pm.",
    "emoji test 🙂🚀 and punctuation?!",
    " ".join(["A very long sentence that repeats itself to run past the maximum length."] * 30),
    "The mitochondria is the powerhouse of the cell.",
]


# -- Hugging Face model folders -----------------------------------------------------------------
def read_texts(path: Path) -> np.ndarray:
    """Golden sentences: a ``.txt`` file (one per line, blank lines skipped) or an ``.npz`` with
    one string array (``TEXT`` / ``in__TEXT``). Returns TEXT [N,1] of UTF-8 bytes."""
    if path.suffix == ".npz":
        ins, _ = split_npz(read_npz(path))
        if len(ins) != 1:
            raise SourceError(f"{path}: a text model takes one input array, found {sorted(ins)}")
        values = next(iter(ins.values())).reshape(-1)
        if values.dtype.kind not in "SU":
            raise SourceError(f"{path}: the golden texts must be a string array, not {values.dtype}")
        items = [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in values.tolist()]
    else:
        try:
            items = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        except (OSError, UnicodeDecodeError) as exc:
            raise SourceError(f"cannot read golden sentences from {path}: {exc}") from None
    if not items:
        raise SourceError(f"{path} holds no golden sentences")
    return text_array(items)


def text_array(items: Sequence[str]) -> np.ndarray:
    """Sentences as the TEXT tensor Triton sends: [N,1] object array of UTF-8 bytes."""
    return np.array([s.encode("utf-8") for s in items], dtype=object).reshape(-1, 1)


def _hf_head(config: Any, task: str | None) -> str:
    """``classifier``/``regression`` for a sequence-classification model, else ``embedding``."""
    archs = list(getattr(config, "architectures", None) or [])
    seq_cls = any(a.endswith("ForSequenceClassification") for a in archs)
    if task == "embedding" or (task is None and not seq_cls):
        return "embedding"  # a classifier's encoder also embeds: its base model, pooled
    if not seq_cls:
        raise SourceError(f"--task {task} needs a sequence-classification model; this one is "
                          f"{', '.join(archs) or 'an unnamed architecture'}")
    inferred = "regression" if config.num_labels == 1 or config.problem_type == "regression" else "classifier"
    if task is not None and task != inferred:
        raise SourceError(f"this model has {config.num_labels} label(s) ({config.problem_type or 'single-label'}): "
                          f"it is a {inferred}, not a {task}")
    return inferred


def _st_pooling(path: Path) -> tuple[str, bool]:
    """(pooling, normalise) from a sentence-transformers folder (``modules.json``); a plain
    encoder folder gets mean pooling + L2 normalisation, as ``examples.minilm``."""
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return "mean", True
    try:
        modules = json.loads(modules_file.read_text())
        pool_dir = next((m.get("path", "") for m in modules if m.get("type", "").endswith(".Pooling")), None)
        normalize = any(m.get("type", "").endswith(".Normalize") for m in modules)
        pool_cfg = json.loads((path / pool_dir / "config.json").read_text()) if pool_dir is not None else {}
    except (OSError, ValueError, AttributeError) as exc:
        raise SourceError(f"cannot read the sentence-transformers configuration of {path}: {exc}") from None
    modes = [k.removeprefix("pooling_mode_").removesuffix("_tokens").removesuffix("_token")
             for k, v in pool_cfg.items() if k.startswith("pooling_mode_") and v is True]
    if not modes:
        return "mean", normalize
    if modes not in (["mean"], ["cls"]):
        raise SourceError(f"{path}: pooling {'+'.join(modes)} is not supported (mean or cls)")
    return modes[0], normalize


def _hf_max_length(path: Path, tokenizer: Any, config: Any) -> int:
    st = path / "sentence_bert_config.json"
    if st.is_file():
        try:
            value = json.loads(st.read_text()).get("max_seq_length")
        except (OSError, ValueError):
            value = None
        if isinstance(value, int) and value > 0:
            return value
    limits = [HF_MAX_LENGTH, getattr(tokenizer, "model_max_length", None),
              getattr(config, "max_position_embeddings", None)]
    return min(v for v in limits if isinstance(v, int) and v > 0)


@functools.cache
def _hf_wrappers() -> tuple[type, type]:
    """nn.Module wrappers, defined on first use (this module does not import torch at import)."""
    import torch  # noqa: PLC0415 - defers a heavy import
    from torch import nn  # noqa: PLC0415 - defers a heavy import

    class PooledEncoder(nn.Module):
        """(input_ids, attention_mask) [N,S] int64 -> sentence_embedding [N,D]: the encoder's
        last hidden state, mean- (over the attention mask) or CLS-pooled, L2-normalised if asked."""

        def __init__(self, encoder: nn.Module, pooling: str = "mean", normalize: bool = True):
            super().__init__()
            self.encoder, self.pooling, self.normalize = encoder, pooling, normalize

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            if self.pooling == "cls":
                pooled = hidden[:, 0]
            else:
                mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
                # clamp: an all-padding row must give zeros, not NaN
                pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
            return nn.functional.normalize(pooled, p=2.0, dim=1) if self.normalize else pooled

    class SequenceClassifier(nn.Module):
        """(input_ids, attention_mask) -> probabilities (softmax; sigmoid for multi-label) or,
        for a one-label regression head, the score."""

        def __init__(self, model: nn.Module, activation: str):
            super().__init__()
            self.model, self.activation = model, activation

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            logits = self.model(input_ids=input_ids, attention_mask=attention_mask).logits
            if self.activation == "softmax":
                return torch.softmax(logits, dim=-1)
            return torch.sigmoid(logits) if self.activation == "sigmoid" else logits

    return PooledEncoder, SequenceClassifier


def from_hf_dir(path: Path, *, texts: np.ndarray | None = None, task: str | None = None,
                max_length: int | None = None) -> ExportSpec:
    """A local Hugging Face model folder (offline) as a text model: tokenizer -> artifact.
    Golden inputs: ``texts`` (TEXT [N,1]) or :data:`GOLDEN_SENTENCES`; the reference embeds
    them one at a time with the torch model, unpadded, as a user would."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = Path(path)
    if task is not None and task not in TASKS:
        raise SourceError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
    try:
        import torch  # noqa: PLC0415 - defers a heavy import
        from transformers import (  # noqa: PLC0415
            AutoConfig,
            AutoModel,
            AutoModelForSequenceClassification,
            AutoTokenizer,
        )
    except ImportError:
        raise SourceError("Hugging Face sources need the `transformers` package") from None
    try:
        config = AutoConfig.from_pretrained(str(path))
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:  # noqa: BLE001 - transformers raises OSError, ValueError, KeyError…
        raise SourceError(f"cannot load {path} as a Hugging Face model: {first_line(exc)}") from None
    head = _hf_head(config, task)
    PooledEncoder, SequenceClassifier = _hf_wrappers()  # noqa: N806
    try:
        # eager attention: the implementation the ONNX export recipe was verified with
        if head == "embedding":
            pooling, normalize = _st_pooling(path)
            base = AutoModel.from_pretrained(str(path), attn_implementation="eager", dtype=torch.float32)
            module = PooledEncoder(base, pooling, normalize)
            out_name, public = "sentence_embedding", "EMBEDDING"
        else:
            model = AutoModelForSequenceClassification.from_pretrained(
                str(path), attn_implementation="eager", dtype=torch.float32)
            activation = ("identity" if head == "regression" else
                          "sigmoid" if config.problem_type == "multi_label_classification" else "softmax")
            module = SequenceClassifier(model, activation)
            out_name, public = ("score", "SCORE") if head == "regression" else ("probabilities", "PROBS")
    except SourceError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise SourceError(f"cannot load the model in {path}: {first_line(exc)}") from None
    module = module.eval()
    max_length = max_length or _hf_max_length(path, tokenizer, config)
    texts = text_array(GOLDEN_SENTENCES) if texts is None else texts

    def embed(items: Sequence[str]) -> np.ndarray:
        with torch.inference_mode():
            enc = tokenizer(list(items), truncation=True, max_length=max_length, return_tensors="pt",
                            padding=True)
            return module(enc["input_ids"], enc["attention_mask"]).numpy()

    def reference(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The torch model, one sentence at a time: no padding at all."""
        items = [x.decode("utf-8") if isinstance(x, bytes) else str(x) for x in inputs["TEXT"].reshape(-1)]
        return {public: np.concatenate([embed([t]) for t in items]).astype(np.float32)}

    try:
        dims = tuple(embed(["dims probe"]).shape[1:])
    except Exception as exc:  # noqa: BLE001 - e.g. an encoder-decoder model with no last_hidden_state
        raise SourceError(f"cannot run the model in {path} as a {head} on text: {first_line(exc)}") from None
    return ExportSpec(
        module=module,
        inputs=[TensorDef(name="input_ids", dtype="int64", dims=(-1,)),
                TensorDef(name="attention_mask", dtype="int64", dims=(-1,))],
        outputs=[TensorDef(name=out_name, dtype="float32", dims=dims)],
        golden_inputs={"TEXT": texts}, task=head, max_batch_size=64,
        text=TextFront(tokenizer_dir=path, max_length=max_length, public_output=public),
        reference=reference,
    )
