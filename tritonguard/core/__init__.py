"""The core plane: what every other plane stands on, importing nothing of tritonguard above it.

- :mod:`.errors`: the error types a client's answer is made from (code + message);
- :mod:`.config`: parameters -> dataclasses (unknown keys refused), and the config layers
  (defaults < [tool.tritonguard] < TRITONGUARD_* < config.pbtxt);
- :mod:`.tensors`: signatures and the fuse/split helpers of a batch;
- :mod:`.repository`: config.pbtxt through Triton's schema, version folders, manifests, goldens;
- :mod:`.files`: the one atomic write;
- :mod:`.store`: where the shared store is (``TRITONGUARD_STATE_URL``) and the file lock;
- :mod:`.outage`: backoff after a store or tier failure;
- :mod:`.catalogue`: every metric tritonguard exports, by name.
"""
