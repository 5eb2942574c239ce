"""The audit log: an append-only, hash-chained JSON Lines file, anchored outside the log.

- :mod:`~tritonguard.privacy.audit.chain`: what a record is, how it is hashed and linked
  (``GENESIS``, ``canonical``, ``record_hash``, ``digest``), and the chain's rotated files;
- :mod:`~tritonguard.privacy.audit.anchors`: the chain's head kept outside the log
  (``<path>.anchor``, the file and the Redis store), signed with the audit key;
- :mod:`~tritonguard.privacy.audit.log`: ``AuditConfig`` and ``AuditLog``, the non-blocking writer
  (queue, batches, fsync, rotation, gap and truncation records, anchoring);
- :mod:`~tritonguard.privacy.audit.verify`: ``verify`` and ``VerifyResult``, the check that
  ``exporter audit verify`` runs.

Arrows: ``chain`` <- ``anchors`` <- {``log``, ``verify``}. May import :mod:`tritonguard.core` only
(errors, atomic write, backoff, the store's file lock and URL); never the guard, rollout or
exporter. Nothing is re-exported here: import a name from the module that defines it.
"""
