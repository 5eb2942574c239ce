"""Triton entry of the `runtime` backend: serves model.onnx / model.pt / model.plan."""

from tritonguard.runtime import RuntimeModel as TritonPythonModel  # noqa: F401
