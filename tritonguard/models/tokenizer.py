"""The ``tokenizer`` Python-based backend: TEXT (BYTES) -> input_ids, attention_mask (INT64).

All texts of an ``execute()`` are tokenised in one fast-tokenizer batch call and padded to the
longest of them, so the responses share one sequence length and the encoder downstream in the
ensemble can batch them together again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tritonguard.core.config import from_params, model_parameters
from tritonguard.core.errors import ConfigError
from tritonguard.core.tensors import ModelSignature, offsets
from tritonguard.triton import backend as triton

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class TokenizerConfig:
    tokenizer_dir: str = "tokenizer"  # relative to the version folder
    max_length: int = 256
    text_input: str = "TEXT"

    def __post_init__(self) -> None:
        if self.max_length < 2:
            raise ValueError("max_length must be >= 2")


class Tokenizer:
    """A version's tokenizer folder, loaded: texts -> the model's outputs (input_ids,
    attention_mask), padded to the longest text. Used by the backend below and by the guard's
    in-process placement (:mod:`tritonguard.models.chain`), so both tokenise alike."""

    def __init__(self, version_dir: Path, config: TokenizerConfig, output_names: list[str], *, model: str = "?"):
        path = Path(version_dir) / config.tokenizer_dir
        if not path.is_dir():
            raise ConfigError(f"model '{model}': tokenizer folder {path} is missing")
        from transformers import AutoTokenizer  # noqa: PLC0415

        self.config, self.output_names = config, list(output_names)
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))

    def encode(self, texts: list[str]) -> dict[str, np.ndarray]:
        enc = self.tokenizer(texts, padding="longest", truncation=True,
                             max_length=self.config.max_length, return_tensors="np")
        return {n: enc[n].astype(np.int64) for n in self.output_names}


def texts_of(array: np.ndarray) -> list[str]:
    """A BYTES tensor [batch, 1] (or [batch]) -> one str per row (undecodable bytes replaced)."""
    return [(x.decode("utf-8", "replace") if isinstance(x, bytes) else str(x))
            for x in array.reshape(len(array), -1)[:, 0]]


class TokenizerModel:
    def initialize(self, args: dict[str, str]) -> None:
        a = triton.prologue(args)
        self.name = a.name
        self.config = from_params(TokenizerConfig, model_parameters(a.config), model=self.name)
        self.signature = ModelSignature.from_config(a.config)
        self.output_names = [s.name for s in self.signature.outputs]
        self.tokenizer = Tokenizer(a.version_dir, self.config, self.output_names, model=self.name)

    def encode(self, texts: list[str]) -> dict[str, np.ndarray]:
        return self.tokenizer.encode(texts)

    def execute(self, requests: list[Any]) -> list[Any]:
        try:
            arrays = [triton.request_inputs(r, [self.config.text_input])[self.config.text_input] for r in requests]
            sizes = [a.shape[0] for a in arrays]
            texts = [t for a in arrays for t in texts_of(a)]
            enc = self.encode(texts)
            starts = offsets(sizes)
            return [triton.response({n: enc[n][starts[i]:starts[i + 1]] for n in self.output_names})
                    for i in range(len(requests))]
        except Exception as exc:  # noqa: BLE001
            log.exception("tokenizer %s failed", self.name)
            return [triton.error(f"tokenizer '{self.name}' failed: {type(exc).__name__}") for _ in requests]

    def finalize(self) -> None:
        self.tokenizer = None
