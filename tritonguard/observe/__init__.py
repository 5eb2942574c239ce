"""The observe plane: what the guards tell about themselves beside metrics.

- :mod:`.tracing`: OpenTelemetry spans per stage, joined to Triton's trace (off: never imported);
- :mod:`.cost`: compute and cost per answered request.

May import: :mod:`tritonguard.core`.
"""
