"""The guard plane: the ``guard`` backend, in front of a model (batches) or a generator (streams).

- :mod:`.config`: a guard's parameters and its signature rules (the contract the exporter reads);
- :mod:`.pipeline`: a batch (and a generation) through an ordered list of stages;
- :mod:`.stages`: one concern a module (validate, tenancy, redact, keys, cache, route, respond,
  feedback, audit, cost, trace);
- :mod:`.validation`: whole-batch input validation;
- :mod:`.services`: the batch guard's privacy services and its stage builder;
- :mod:`.routing`: versions, breakers, goldens, comparisons (the router and its collaborators);
- :mod:`.model`: the request/response guard; :mod:`.stream`: the decoupled guard;
- :mod:`.entry`: the ``guard`` backend's Triton entry (picks one of the two).

May import every plane below it: generation, models, ops, triton, rollout, privacy, observe, core.
"""
