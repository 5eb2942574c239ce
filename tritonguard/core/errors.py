"""Exception hierarchy. Each carries the Triton status code its message should travel with."""

from __future__ import annotations


class TritonGuardError(Exception):
    """Base class; ``code`` names a ``pb_utils.TritonError`` code attribute."""

    code = "INTERNAL"


class ConfigError(TritonGuardError):
    """A model's configuration is invalid; raised from ``initialize`` so the load fails."""


class InvalidInput(TritonGuardError):
    """A request's input breaks a rule: HTTP 400 / gRPC INVALID_ARGUMENT."""

    code = "INVALID_ARG"

    def __init__(self, input_name: str, rule: str, detail: str):
        self.input_name = input_name
        self.rule = rule
        super().__init__(f"input '{input_name}' violates {rule}: {detail}")


class TargetError(TritonGuardError):
    """The guarded target failed; keeps the target's status code."""

    def __init__(self, message: str, code: str = "INTERNAL"):
        super().__init__(message)
        self.code = code


class QuotaExceeded(TritonGuardError):
    """A tenant is over its quota: HTTP 503 / gRPC UNAVAILABLE, with retry advice in the message."""

    code = "UNAVAILABLE"
