"""Input validation over a whole dynamic batch.

Cheap structural checks (presence, dtype, shape, batch size, payload size) run per request;
value checks (NaN/Inf, ranges) run once over the fused batch and are mapped back to requests
with ``reduceat``; BYTES checks (length, UTF-8) are per element, as they must be. A failing
request gets an :class:`InvalidInput` naming the input and the rule; its neighbours go on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from tritonguard.core.errors import ConfigError, InvalidInput
from tritonguard.core.tensors import ModelSignature, TensorSpec, concat, offsets, rows_any

Inputs = Mapping[str, np.ndarray]


@dataclass(kw_only=True)
class ValidationConfig:
    """``validation.*`` parameters of a guard model."""

    DYNAMIC_PREFIXES = ("range",)

    max_payload_bytes: int = 16 * 1024 * 1024  # per request, all inputs together
    max_bytes_length: int = 64 * 1024  # per BYTES element
    allow_non_finite: bool = False
    require_utf8: bool = True
    # ``validation.range.IMAGE = "0,16"``: inclusive bounds per input
    range: dict[str, tuple[float, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.max_payload_bytes <= 0:
            raise ValueError("validation.max_payload_bytes must be > 0")
        if self.max_bytes_length <= 0:
            raise ValueError("validation.max_bytes_length must be > 0")
        parsed: dict[str, tuple[float, float]] = {}
        for name, raw in self.range.items():
            if isinstance(raw, tuple):
                lo, hi = raw
            else:
                parts = [p.strip() for p in str(raw).split(",")]
                if len(parts) != 2:
                    raise ValueError(f"validation.range.{name} must be 'min,max', got {raw!r}")
                lo = float(parts[0]) if parts[0] else -np.inf
                hi = float(parts[1]) if parts[1] else np.inf
            if lo > hi:
                raise ValueError(f"validation.range.{name}: min {lo:g} > max {hi:g}")
            parsed[name] = (float(lo), float(hi))
        self.range = parsed

    def check_against(self, signature: ModelSignature, model: str) -> None:
        names = {s.name for s in signature.inputs}
        for name in self.range:
            if name not in names:
                raise ConfigError(f"model '{model}': validation.range.{name} names no input (inputs: {', '.join(sorted(names))})")
            if signature.input(name).is_bytes:
                raise ConfigError(f"model '{model}': validation.range.{name} on a BYTES input")


@dataclass
class BatchVerdict:
    """Result of validating one execute() batch."""

    errors: list[InvalidInput | None]  # one per request
    fused: dict[str, np.ndarray]  # inputs of the valid requests, concatenated
    sizes: list[int]  # batch size per valid request, in order
    valid: list[int] = dataclasses.field(default_factory=list)  # request indices that passed

    @property
    def starts(self) -> np.ndarray:
        return offsets(self.sizes)


class BatchValidator:
    def __init__(self, signature: ModelSignature, config: ValidationConfig):
        self.signature = signature
        self.config = config
        self._float_inputs = [s for s in signature.inputs if np.issubdtype(s.dtype, np.floating)]
        self._bytes_inputs = [s for s in signature.inputs if s.is_bytes]
        self._int_ranges = [n for n in config.range
                            if not np.issubdtype(signature.input(n).dtype, np.floating)]

    # -- per request, structural -------------------------------------------------------
    def _structural(self, inputs: Inputs) -> tuple[InvalidInput | None, int]:
        sig = self.signature
        batched = sig.max_batch_size > 0
        batch = -1
        payload = 0
        for spec in sig.inputs:
            arr = inputs.get(spec.name)
            if arr is None:
                return InvalidInput(spec.name, "presence", "required input is missing"), 0
            if arr.dtype != spec.dtype and not (spec.is_bytes and arr.dtype.kind in "OSU"):
                return InvalidInput(spec.name, "dtype", f"expected {spec.triton_type}, got {arr.dtype}"), 0
            shape = arr.shape
            if batched:
                if not shape:
                    return InvalidInput(spec.name, "shape", "missing batch dimension"), 0
                n, shape = shape[0], shape[1:]
                if n < 1 or n > sig.max_batch_size:
                    return InvalidInput(spec.name, "batch_size", f"batch size {n} not in 1..{sig.max_batch_size}"), 0
                if batch >= 0 and n != batch:
                    return InvalidInput(spec.name, "batch_size", f"batch size {n} differs from other inputs ({batch})"), 0
                batch = n
            if shape != spec.dims and not spec.shape_ok(shape):
                want = "[" + ",".join(str(d) for d in spec.dims) + "]"
                return InvalidInput(spec.name, "shape", f"expected {want} per item, got {list(shape)}"), 0
            if spec.is_bytes:
                payload += sum(len(x) for x in arr.flat if isinstance(x, (bytes, str)))
            else:
                payload += arr.nbytes
        if payload > self.config.max_payload_bytes:
            return InvalidInput("*", "max_payload_bytes", f"{payload} bytes > {self.config.max_payload_bytes}"), 0
        return None, (batch if batch >= 0 else 1)

    def _bytes_errors(self, spec: TensorSpec, arr: np.ndarray) -> InvalidInput | None:
        limit = self.config.max_bytes_length
        for item in arr.flat:
            if isinstance(item, str):
                item = item.encode()
            if not isinstance(item, bytes):
                return InvalidInput(spec.name, "dtype", f"BYTES element of type {type(item).__name__}")
            if len(item) > limit:
                return InvalidInput(spec.name, "max_bytes_length", f"element of {len(item)} bytes > {limit}")
            if self.config.require_utf8:
                try:
                    item.decode("utf-8")
                except UnicodeDecodeError as exc:
                    return InvalidInput(spec.name, "utf8", f"not valid UTF-8 at byte {exc.start}")
        return None

    # -- whole batch ------------------------------------------------------------------
    def validate(self, requests: Sequence[Inputs]) -> BatchVerdict:
        errors: list[InvalidInput | None] = [None] * len(requests)
        sizes: list[int] = []
        valid: list[int] = []
        for i, inputs in enumerate(requests):
            err, n = self._structural(inputs)
            if err is None:
                for spec in self._bytes_inputs:
                    err = self._bytes_errors(spec, inputs[spec.name])
                    if err is not None:
                        break
            if err is None:
                valid.append(i)
                sizes.append(n)
            else:
                errors[i] = err
        fused = self._fuse(requests, valid)
        bad = self._value_errors(fused, sizes)
        if bad:
            for pos, err in bad.items():
                errors[valid[pos]] = err
            keep = [p for p in range(len(valid)) if p not in bad]
            valid = [valid[p] for p in keep]
            sizes = [sizes[p] for p in keep]
            fused = self._fuse(requests, valid)
        return BatchVerdict(errors, fused, sizes, valid)

    def _fuse(self, requests: Sequence[Inputs], idx: Sequence[int]) -> dict[str, np.ndarray]:
        if not idx:
            return {}
        if self.signature.max_batch_size > 0:
            return {s.name: concat([requests[i][s.name] for i in idx]) for s in self.signature.inputs}
        # no batching: one request per execute slot, nothing to fuse
        return {s.name: requests[idx[0]][s.name] for s in self.signature.inputs}

    def _value_errors(self, fused: Mapping[str, np.ndarray], sizes: Sequence[int]) -> dict[int, InvalidInput]:
        if not fused:
            return {}
        bad: dict[int, InvalidInput] = {}
        starts: np.ndarray | None = None
        for spec in self._float_inputs:
            arr = fused[spec.name]
            lo, hi = self.config.range.get(spec.name, (-np.inf, np.inf))
            check_finite = not self.config.allow_non_finite
            # Fast path, one pass each over the whole batch: NaN propagates through min/max and
            # Inf exceeds any finite bound, so a clean batch never reaches the per-row work.
            mn, mx = arr.min(), arr.max()
            if (not check_finite or np.isfinite(mn) and np.isfinite(mx)) and lo <= mn and mx <= hi:
                continue
            if starts is None:
                starts = offsets(sizes)
            rows = arr.reshape(int(starts[-1]), -1)
            if check_finite:
                for pos in np.flatnonzero(rows_any(~np.isfinite(rows).all(axis=1), starts)):
                    bad.setdefault(int(pos), InvalidInput(spec.name, "finite", "NaN or Inf values are not allowed"))
            if spec.name in self.config.range:
                with np.errstate(invalid="ignore"):
                    row_bad = ((rows < lo) | (rows > hi)).any(axis=1)
                for pos in np.flatnonzero(rows_any(row_bad, starts)):
                    bad.setdefault(int(pos), InvalidInput(spec.name, "range", f"values must lie in [{lo:g}, {hi:g}]"))
        for name in self._int_ranges:
            arr = fused[name]
            lo, hi = self.config.range[name]
            if lo <= arr.min() and arr.max() <= hi:
                continue
            if starts is None:
                starts = offsets(sizes)
            rows = arr.reshape(int(starts[-1]), -1)
            for pos in np.flatnonzero(rows_any(((rows < lo) | (rows > hi)).any(axis=1), starts)):
                bad.setdefault(int(pos), InvalidInput(name, "range", f"values must lie in [{lo:g}, {hi:g}]"))
        return bad
