"""The hosts plane: the guard where the model is not served by Triton (issue 44).

- :mod:`.asgi`: :class:`~tritonguard.hosts.asgi.GuardMiddleware`, pure ASGI middleware for a
  FastAPI / Starlette service: tenants and quotas, redaction of JSON and text bodies, audit,
  served-by attribution and version routing by the rollout state, with the guard's metric names.
- :mod:`.ray_serve`: :func:`~tritonguard.hosts.ray_serve.guarded`, a Ray Serve application that
  serves a repository's versions behind the guard (``@serve.batch`` as the dynamic batcher).
- :mod:`.common`: what both share (config parsing, admission, routes, audit, metric families).

Adapters beside :mod:`tritonguard.triton`: they use the guard's configuration, stores and stages,
never python_backend. May import: :mod:`tritonguard.guard` and every plane below it; nothing
below imports this plane (tests/unit/test_architecture.py).
"""
