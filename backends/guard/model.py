"""Triton entry of the `guard` backend: the safety pipeline in front of a target model.

A decoupled guard (``model_transaction_policy { decoupled: true }``) guards a streaming generator
(:class:`tritonguard.guard.stream.StreamGuardModel`); any other one a request/response model
(:class:`tritonguard.guard.model.GuardModel`). ``initialize`` picks one and binds its ``execute`` and
``finalize`` onto this instance, so the stub calls them directly, with no extra hop per batch.
"""

import json


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        if (config.get("model_transaction_policy") or {}).get("decoupled"):
            from tritonguard.guard.stream.model import StreamGuardModel as Model  # noqa: PLC0415
        else:
            from tritonguard.guard.model import GuardModel as Model  # noqa: PLC0415
        self.model = Model()
        self.model.initialize(args)
        self.execute = self.model.execute
        self.finalize = self.model.finalize
