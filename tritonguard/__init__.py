"""tritonguard: a safety layer for NVIDIA Triton, as Python-based backends and a control CLI.

The library is split into planes; a plane imports only planes below it (checked by
``tests/unit/test_architecture.py``; the map: docs/architecture.md)::

    guard                                   the guards: batch and stream, stages, routing
      -> generation, models, ops            the generator, runtime/tokenizer/intake, launcher/supervisor
        -> triton, rollout, privacy, observe  the python_backend adapter, the rollout contract,
                                              privacy libraries, tracing and cost
          -> core                           errors, config layers, tensors, repository, store primitives

``backends/<name>/model.py`` are three-line Triton entries that import it. Only
:mod:`tritonguard.triton` touches ``triton_python_backend_utils``, so everything else is testable
without a server.
"""

__version__ = "0.1.0"
