"""The ``tokenizer`` Python-based backend: TEXT (BYTES) -> input_ids, attention_mask (INT64).

All texts of an ``execute()`` are tokenised in one fast-tokenizer batch call and padded to the
longest of them, so the responses share one sequence length and the encoder downstream in the
ensemble can batch them together again.
"""

from __future__ import annotations

import json
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


# what a fast tokenizer's Encoding calls each output a tokenizer model can have
ENCODING_FIELDS = {"input_ids": "ids", "attention_mask": "attention_mask", "token_type_ids": "type_ids"}


class Tokenizer:
    """A version's tokenizer folder, loaded: texts -> the model's outputs (input_ids,
    attention_mask), padded to the longest text. Used by the backend below and by the guard's
    in-process placement (:mod:`tritonguard.models.chain`), so both tokenise alike.

    A folder with ``tokenizer.json`` (a fast tokenizer, what the exporter writes) is run by the
    ``tokenizers`` library alone, set up as ``transformers`` sets it for the call
    ``tokenizer(texts, padding="longest", truncation=True, max_length=…)``: the same ids (checked
    against transformers in tests/unit/models/test_tokenizer.py). transformers is imported only
    for a folder without one: importing it imports torch, ~4 s of CPU and ~1 GB of memory in every
    stub that tokenises (the text guard's and the tokenizer's)."""

    def __init__(self, version_dir: Path, config: TokenizerConfig, output_names: list[str], *, model: str = "?"):
        path = Path(version_dir) / config.tokenizer_dir
        if not path.is_dir():
            raise ConfigError(f"model '{model}': tokenizer folder {path} is missing")
        self.config, self.output_names = config, list(output_names)
        self.fast = _fast_tokenizer(path, config.max_length)
        if self.fast is not None:
            unknown = [n for n in self.output_names if n not in ENCODING_FIELDS]
            if unknown:
                raise ConfigError(f"model '{model}': output {unknown[0]!r} is not one a tokenizer gives "
                                  f"({', '.join(ENCODING_FIELDS)})")
            self.tokenizer = None
        else:
            from transformers import AutoTokenizer  # noqa: PLC0415

            self.tokenizer = AutoTokenizer.from_pretrained(str(path))

    def encode(self, texts: list[str]) -> dict[str, np.ndarray]:
        if self.fast is None:
            enc = self.tokenizer(texts, padding="longest", truncation=True,
                                 max_length=self.config.max_length, return_tensors="np")
            return {n: enc[n].astype(np.int64) for n in self.output_names}
        encodings = self.fast.encode_batch(texts)
        return {n: np.array([getattr(e, ENCODING_FIELDS[n]) for e in encodings], dtype=np.int64).reshape(len(texts), -1)
                for n in self.output_names}


def _fast_tokenizer(path: Path, max_length: int) -> Any:
    """``path/tokenizer.json`` with truncation to ``max_length`` and padding to the longest text
    as ``tokenizer_config.json`` says (side, pad token); None when the folder has no
    ``tokenizer.json`` or its config names no pad token (transformers then finds one elsewhere
    and runs it). ``pad_to_multiple_of`` in the config is not applied: transformers does not
    apply it to this call either."""
    if not (path / "tokenizer.json").is_file():
        return None
    try:
        cfg = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        cfg = {}
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path / 'tokenizer_config.json'}: {exc}") from None
    pad = cfg.get("pad_token")
    pad = pad.get("content") if isinstance(pad, dict) else pad
    if not isinstance(pad, str):
        return None
    import tokenizers  # noqa: PLC0415

    tok = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    pad_id = tok.token_to_id(pad)
    if pad_id is None:
        return None
    tok.enable_truncation(max_length=max_length, stride=0, strategy="longest_first",
                          direction=cfg.get("truncation_side", "right"))
    tok.enable_padding(direction=cfg.get("padding_side", "right"), pad_id=pad_id,
                       pad_type_id=int(cfg.get("pad_token_type_id", 0)), pad_token=pad)
    return tok


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
