"""The rollout plane: the contract between the guards and the exporter's rollout controller.

- :mod:`.state`: the rollout state document (primary, candidate, arms, shadow, chain, goldens,
  breakers, judges) and its stores (a file with a lock, or Redis);
- :mod:`.breaker`: a version's circuit breaker with hysteresis;
- :mod:`.latency`: exact per-call latencies shared through the store (the latency gate's data);
- :mod:`.feedback`: what each version answered, for labels that arrive later;
- :mod:`.drift`: input drift against a version's reference;
- :mod:`.validators`: per-workload validators of two versions' outputs;
- :mod:`.judging`: the operator-owned limits of a task judge without labels.

May import: :mod:`tritonguard.core`.
"""
