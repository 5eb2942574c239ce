"""The ``guard`` backend's Triton entry: a decoupled guard (``model_transaction_policy
{ decoupled: true }``) guards a streaming generator (:class:`tritonguard.guard.stream.model.StreamGuardModel`);
any other one a request/response model (:class:`tritonguard.guard.model.GuardModel`).
``initialize`` picks one and binds its ``execute`` and ``finalize`` onto this instance, so the stub
calls them directly, with no extra hop per batch."""

from __future__ import annotations

import json
from typing import Any

from tritonguard.guard.model import GuardModel
from tritonguard.guard.stream.model import StreamGuardModel


class GuardBackend:
    def initialize(self, args: dict[str, str]) -> None:
        decoupled = (json.loads(args["model_config"]).get("model_transaction_policy") or {}).get("decoupled")
        self.model: Any = StreamGuardModel() if decoupled else GuardModel()
        self.model.initialize(args)
        self.execute = self.model.execute
        self.finalize = self.model.finalize
