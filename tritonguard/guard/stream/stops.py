"""A client's stop of its own generation, without cancelling its stream.

A client that no longer wants an answer (the OpenAI front, whose HTTP client went away) could
cancel its gRPC stream; on Triton 2.51 a cancel that lands as the answer ends can keep the model
counted live, and the next server stop then waits its whole exit timeout
(docs/stream-guard.md). Instead it sends the guard a **stop request**: a request whose id is
:data:`~tritonguard.generation.contract.STOP_PREFIX` followed by the id of the generation to stop,
with the same credential. The guard answers it at once with a plain final response and leaves a
stop file in the directory the models of its tritonserver share
(:func:`~tritonguard.generation.contract.stop_dir`), so whichever guard instance holds the
generation (each is its own process) sees it at its next cancel poll, stops the target, and ends
that stream with a plain final response: the client reads it to its end, nothing is cancelled.

The file is named by a digest of the guard, the tenant and the request id: a stop only reaches a
generation of the same tenant (a client choosing its own ids cannot stop another tenant's), and
no client text reaches a file name. Files nobody took (the generation had already ended) are
removed after :data:`~tritonguard.generation.engine.STOP_TTL_S` by the next stop request, or by a
``generator`` engine's scan of the same directory.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tritonguard.core.errors import InvalidInput, TritonGuardError
from tritonguard.generation.contract import STOP_PREFIX, stop_dir, write_stop
from tritonguard.generation.engine import STOP_TTL_S
from tritonguard.triton import backend as triton

log = logging.getLogger(__name__)
FILE_PREFIX = "guard-"
PRUNE_EVERY_S = 10.0


class StopUnavailable(TritonGuardError):
    """This guard cannot take stop requests (no shared stop directory): cancel the stream."""

    code = "UNAVAILABLE"


def is_stop(request_id: str) -> bool:
    return request_id.startswith(STOP_PREFIX)


class ClientStops:
    """Stop requests of one guard (``guard``: its name; ``tenant_of(params)``: the tenant a
    request names, as its tenancy stage admits it (:meth:`TenancyStage.tenant_of
    <tritonguard.guard.stages.tenancy.TenancyStage.tenant_of>`), raising its refusal;
    ``directory``: the shared stop files)."""

    def __init__(self, guard: str, tenant_of: Callable[[dict[str, Any]], str], directory: Path | None = None) -> None:
        self.guard, self.tenant = guard, tenant_of
        self.directory = stop_dir() if directory is None else directory
        self._pruned = 0.0

    def file_name(self, tenant: str, request_id: str) -> str:
        digest = hashlib.sha256(f"{self.guard}\0{tenant}\0{request_id}".encode()).hexdigest()[:40]
        return FILE_PREFIX + digest

    def ask(self, request_id: str, params: dict[str, Any]) -> None:
        """A stop request (its own id ``STOP_PREFIX + <id>``): the stop file of generation
        ``<id>`` of the request's tenant. Raises the tenancy's refusal for a bad credential,
        :class:`InvalidInput` for no id, :class:`StopUnavailable` without a stop directory."""
        target = request_id[len(STOP_PREFIX):]
        if not target:
            raise InvalidInput("request_id", "stop_request", f"a stop request names the id of the generation "
                               f"to stop after '{STOP_PREFIX}'")
        tenant = self.tenant(params)
        if self.directory is None or not write_stop(self.directory, self.file_name(tenant, target)):
            raise StopUnavailable(f"model '{self.guard}': stop requests cannot be taken here (no shared stop "
                                  "directory); cancel the stream instead")
        self._prune()

    def watch(self, request: Any, tenant: str) -> Path | None:
        """The stop file a generation's forwarder polls (None: it cannot be stopped this way,
        no request id or no directory)."""
        rid = triton.request_id(request) if request is not None else ""
        if not rid or self.directory is None:
            return None
        return self.directory / self.file_name(tenant, rid)

    @staticmethod
    def taken(path: Path) -> bool:
        """Whether a stop was asked for (the file is removed: one stop, taken once)."""
        try:
            path.unlink()
            return True
        except OSError:
            return False

    def _prune(self) -> None:
        """Stop files of this kind that no generation took within STOP_TTL_S (it had ended)."""
        now = time.time()
        if now - self._pruned < PRUNE_EVERY_S or self.directory is None:
            return
        self._pruned = now
        try:
            names = [n for n in os.listdir(self.directory) if n.startswith(FILE_PREFIX)]
        except OSError:
            return
        for name in names:
            path = self.directory / name
            try:
                if now - path.stat().st_mtime > STOP_TTL_S:
                    path.unlink()
            except OSError:  # taken or pruned meanwhile
                pass
