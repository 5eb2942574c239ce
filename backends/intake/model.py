"""Triton entry of the `intake` backend: the unbatched first step in front of a text guard."""

from tritonguard.models.intake import IntakeModel as TritonPythonModel  # noqa: F401
