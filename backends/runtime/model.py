"""Triton entry of the `runtime` backend: serves model.onnx / model.pt / model.pt2 / model.plan."""

from tritonguard.models.runtime import RuntimeModel as TritonPythonModel  # noqa: F401
