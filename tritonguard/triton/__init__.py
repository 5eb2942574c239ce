"""The triton plane: the only adapter to python_backend (``triton_python_backend_utils``).

- :mod:`.backend`: the stub module, a backend's ``initialize`` prologue, requests' inputs and
  parameters, responses and errors, one synchronous BLS call;
- :mod:`.metrics`: custom metrics kept in process and pushed by a thread;
- :mod:`.streams`: decoupled responses to a client, BLS streams to a decoupled target;
- :mod:`.http`: a small client of Triton's HTTP API (health, repository, statistics).

May import: :mod:`tritonguard.core`.
"""
