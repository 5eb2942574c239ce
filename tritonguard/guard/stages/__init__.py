"""The stages of the guard's path, one concern per module; :mod:`tritonguard.guard.pipeline` runs them.
A stage serves a batch (``run``) and, where a decoupled guard uses it, one generation (``admit`` /
``piece`` / ``finish`` / ``end``): tenancy, redaction, routing and audit in the same class;
validation and the caches in a ``Stream*Stage`` class beside the batch one.

- :mod:`.validate`: read and validate the whole batch (``validation.*``)
- :mod:`.trace`: start the batch's spans, tag the traced requests (``tracing.*``)
- :mod:`.tenancy`: tenant ids, quotas, and the in-flight slots' release (``tenancy.*``)
- :mod:`.redact`: PII in text inputs and outputs (``redaction.*``)
- :mod:`.keys`: content keys of the rows, for the cache and the audit's digests
- :mod:`.cache`: lookups before routing, fills after (``cache.*``)
- :mod:`.route`: the router: versions, breakers, fallbacks, comparisons (``routing.*``)
- :mod:`.cache` also: a decoupled guard's exact and semantic caches (``semantic_cache.*``)
- :mod:`.respond`: the Triton responses (``SERVED_BY`` included)
- :mod:`.audit`: the audit log's records (``audit.*``)
- :mod:`.cost`: compute and cost per answered request (``cost.*``)
"""
