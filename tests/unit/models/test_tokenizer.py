"""tritonguard.models.tokenizer: a fast tokenizer folder is run by the ``tokenizers`` library
alone and gives exactly the ids transformers gives for the same call (the folder `make setup`
exports for minilm, and variants of its tokenizer_config.json); transformers stays out of the
process unless a folder needs it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tritonguard.core.errors import ConfigError
from tritonguard.models.tokenizer import Tokenizer, TokenizerConfig

ROOT = Path(__file__).resolve().parents[3]
FOLDER = ROOT / "model_repository" / "minilm_tokenizer" / "1" / "tokenizer"
OUTPUTS = ["input_ids", "attention_mask", "token_type_ids"]

TEXTS = [
    "The canary sings.",
    "",
    "  leading and trailing spaces  ",
    "Café au lait, naïve façade: ACCENTS and Capitals",
    "中文字符和日本語のテキスト",
    "emoji 🙂🚀 and symbols <>&%$#@!",
    "tabs\tand\nnewlines\r\nin text",
    "a " * 400,  # past any max_length: truncated
    "supercalifragilisticexpialidocious antidisestablishmentarianism",
    "[CLS] [SEP] [PAD] [MASK] written by a user",
    "numbers 3.14159 1,000,000 -42 0x1F",
]


def _transformers(folder: Path, texts: list[str], max_length: int) -> dict[str, np.ndarray]:
    from transformers import AutoTokenizer

    enc = AutoTokenizer.from_pretrained(str(folder))(texts, padding="longest", truncation=True,
                                                     max_length=max_length, return_tensors="np")
    return {n: enc[n].astype(np.int64) for n in OUTPUTS}


@pytest.mark.parametrize("max_length", [8, 128, 256])
def test_the_same_ids_as_transformers(max_length):
    tok = Tokenizer(FOLDER.parent, TokenizerConfig(max_length=max_length), OUTPUTS)
    assert tok.fast is not None and tok.tokenizer is None
    for batch in (TEXTS, TEXTS[:1], TEXTS[7:8], TEXTS[::-1], [TEXTS[1], TEXTS[1]]):
        ours, theirs = tok.encode(batch), _transformers(FOLDER, batch, max_length)
        for n in OUTPUTS:
            assert ours[n].dtype == np.int64 and np.array_equal(ours[n], theirs[n]), (n, batch[:2])


def test_the_config_sides_and_pad_token_are_followed(tmp_path):
    """Padding and truncation on the left, as a tokenizer_config.json may ask: still the ids
    transformers gives."""
    folder = tmp_path / "1" / "tokenizer"
    shutil.copytree(FOLDER, folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg.update(padding_side="left", truncation_side="left")
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer(folder.parent, TokenizerConfig(max_length=16), OUTPUTS)
    assert tok.fast is not None
    ours, theirs = tok.encode(TEXTS), _transformers(folder, TEXTS, 16)
    assert all(np.array_equal(ours[n], theirs[n]) for n in OUTPUTS)
    assert ours["attention_mask"][1, 0] == 0  # the empty text is padded on the left


def test_a_folder_without_a_pad_token_goes_to_transformers_and_an_unknown_output_is_refused(tmp_path):
    folder = tmp_path / "1" / "tokenizer"
    shutil.copytree(FOLDER, folder)
    with pytest.raises(ConfigError, match="output 'pixel_values' is not one a tokenizer gives"):
        Tokenizer(folder.parent, TokenizerConfig(), ["input_ids", "pixel_values"], model="m")
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    # transformers does not pad this call to a multiple: neither does the fast set-up
    (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "pad_to_multiple_of": 8}))
    tok = Tokenizer(folder.parent, TokenizerConfig(max_length=32), OUTPUTS)
    assert tok.fast is not None and tok.encode(["pad me"])["input_ids"].shape == (1, 4)
    assert np.array_equal(tok.encode(TEXTS)["input_ids"], _transformers(folder, TEXTS, 32)["input_ids"])
    # no pad token in the config (transformers finds one in tokenizer.json): transformers runs it
    (folder / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "pad_token"}))
    tok = Tokenizer(folder.parent, TokenizerConfig(max_length=32), OUTPUTS)
    assert tok.fast is None and tok.tokenizer is not None
    assert tok.encode(["pad me", "a"])["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]


def test_tokenising_imports_neither_transformers_nor_torch():
    """What the tokenizer's and the text guard's stubs pay: one process, a folder loaded, a batch
    encoded, and neither module in it."""
    code = ("import sys; from pathlib import Path; from tritonguard.models.tokenizer import Tokenizer, TokenizerConfig; "
            f"t = Tokenizer(Path({str(FOLDER.parent)!r}), TokenizerConfig(), ['input_ids', 'attention_mask']); "
            "print(t.encode(['a', 'b c'])['input_ids'].shape, [m for m in ('transformers', 'torch') if m in sys.modules])")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "(2, 4) []", r.stdout
