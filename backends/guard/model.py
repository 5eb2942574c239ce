"""Triton entry of the `guard` backend: the safety pipeline in front of a target model."""

from tritonguard.guard.entry import GuardBackend as TritonPythonModel  # noqa: F401
