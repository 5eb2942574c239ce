"""Triton entry of the `tokenizer` backend: TEXT -> input_ids, attention_mask."""

from tritonguard.models.tokenizer import TokenizerModel as TritonPythonModel  # noqa: F401
