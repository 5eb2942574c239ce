"""Triton entry of the `guard` backend: the safety pipeline in front of a target model."""

from tritonguard.guard import GuardModel as TritonPythonModel  # noqa: F401
