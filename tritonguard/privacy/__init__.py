"""The privacy plane: what the guards keep about requests, and whom they serve.

- :mod:`~tritonguard.privacy.tenancy`: tenant ids, their authentication, quotas and token budgets;
- :mod:`~tritonguard.privacy.redaction`: PII found and masked in text, also across the pieces of
  a streamed answer;
- :mod:`~tritonguard.privacy.cache`: the response caches (exact and tiered, encrypted when
  persisted; semantic), keyed so that one tenant never sees another's answers;
- :mod:`~tritonguard.privacy.audit`: the append-only, hash-chained, anchored audit log, which
  holds digests and ids, never request contents.

These are libraries: the guards (:mod:`tritonguard.guard`) wire them into their stages. The
packages here import :mod:`tritonguard.core` only (errors, the store's file lock and URL, atomic
write, backoff), and none of them imports another: no Triton, no guard, no rollout, no exporter.
Nothing is re-exported: import a name from the module that defines it.
"""
