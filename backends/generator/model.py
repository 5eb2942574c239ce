"""Triton entry of the `generator` backend: a decoupled text generator with vLLM's I/O contract."""

from tritonguard.generation.generator import GeneratorModel as TritonPythonModel  # noqa: F401
