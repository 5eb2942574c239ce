"""Triton entry of the `guard` backend: the safety pipeline in front of a target model.

A decoupled guard (``model_transaction_policy { decoupled: true }``) guards a streaming generator
(:class:`tritonguard.stream_guard.StreamGuardModel`); any other one a request/response model
(:class:`tritonguard.guard.GuardModel`). ``initialize`` picks one and binds its ``execute`` and
``finalize`` onto this instance, so the stub calls them directly, with no extra hop per batch.
"""

import json


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        if (config.get("model_transaction_policy") or {}).get("decoupled"):
            from tritonguard.stream_guard import StreamGuardModel as Model  # noqa: PLC0415
        else:
            from tritonguard.guard import GuardModel as Model  # noqa: PLC0415
        self.model = Model()
        self.model.initialize(args)
        self.execute = self.model.execute
        self.finalize = self.model.finalize
