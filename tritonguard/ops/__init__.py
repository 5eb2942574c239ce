"""The ops plane: running Triton, not serving requests.

- :mod:`.launcher`: the ``tritonserver`` / ``perf_analyzer`` entries (backend folder, PATH, libs);
- :mod:`.supervisor`: dead and frozen stubs brought back, a crashed server restarted;
- :mod:`.server`: a real tritonserver on free ports (tests, benchmarks, tuning).

May import: :mod:`tritonguard.triton` (its HTTP client), :mod:`tritonguard.core`.
"""
