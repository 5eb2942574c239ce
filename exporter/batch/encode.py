"""Reading one block of the input and encoding its rows as model inputs: a Parquet slice column
by column (pyarrow, no per-row Python on the good path), JSONL and CSV records row by row. A
row that cannot become a tensor (missing, not numeric, wrong shape, bad UTF-8) is set aside
with its reason, never sent.
"""

from __future__ import annotations

import csv
import io
import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from exporter.batch.job import BatchError, Block, InputSpec, Job, dims_text, np_dtype

# -- reading and encoding a block ------------------------------------------------------------

@dataclass
class Encoded:
    """A block's rows as model inputs: ``rows`` (indices into the block) and their tensors,
    plus the rows that could not become a tensor, with a reason."""

    rows: np.ndarray
    tensors: dict[str, np.ndarray]
    bad: dict[int, tuple[str, str]]


def read_block(block: Block, job: Job) -> Encoded:
    if block.kind == "parquet":
        return _encode_arrow(_read_parquet(block, job), block.rows, job.inputs)
    raw = _read_bytes(block)
    records = _jsonl_records(raw) if block.kind == "jsonl" else _csv_records(raw, job.csv_header)
    if len(records) != block.rows:
        raise BatchError(f"{block.path}: block {block.id} holds {len(records)} records, planned {block.rows}: "
                         "the file changed while the job ran")
    return _encode_records(records, job.inputs)


def _read_parquet(block: Block, job: Job) -> Any:
    import pyarrow.parquet as pq  # noqa: PLC0415 - defers a heavy import

    pf = pq.ParquetFile(block.path)
    columns = sorted({s.column for s in job.inputs})
    batches = pf.iter_batches(batch_size=job.block_rows, row_groups=[block.row_group], columns=columns)
    batch = next(itertools.islice(batches, block.start // job.block_rows, None))
    if batch.num_rows != block.rows:
        raise BatchError(f"{block.path}: block {block.id} holds {batch.num_rows} rows, planned {block.rows}")
    return batch


def _read_bytes(block: Block) -> bytes:
    with open(block.path, "rb") as fh:
        fh.seek(block.start)
        return fh.read(block.end - block.start)


def _jsonl_records(raw: bytes) -> list[dict[str, Any] | tuple[str, str]]:
    out: list[dict[str, Any] | tuple[str, str]] = []
    for line in raw.split(b"\n"):
        if not line.strip():
            continue
        try:
            rec = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError as exc:
            out.append(("utf8", f"record is not valid UTF-8 ({exc.reason} at byte {exc.start})"))
            continue
        except ValueError as exc:
            out.append(("json", f"record is not valid JSON ({exc})"))
            continue
        out.append(rec if isinstance(rec, dict) else ("json", "record is not a JSON object"))
    return out


def _csv_records(raw: bytes, header: str) -> list[dict[str, Any] | tuple[str, str]]:
    names = next(csv.reader([header]))
    out: list[dict[str, Any] | tuple[str, str]] = []
    text = raw.decode("utf-8", errors="surrogateescape")  # a bad byte fails its own record only
    for fields in csv.reader(io.StringIO(text, newline="")):
        if not fields or fields == [""]:
            continue
        if any(_has_surrogates(f) for f in fields):
            out.append(("utf8", "record is not valid UTF-8"))
        elif len(fields) != len(names):
            out.append(("csv", f"record has {len(fields)} fields, the header {len(names)}"))
        else:
            out.append(dict(zip(names, fields, strict=True)))
    return out


def _has_surrogates(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _encode_records(records: list[Any], specs: tuple[InputSpec, ...]) -> Encoded:
    """JSONL / CSV records, row by row (their parsing is per row anyway)."""
    bad: dict[int, tuple[str, str]] = {}
    values: dict[str, list[Any]] = {s.name: [] for s in specs}
    rows: list[int] = []
    for i, rec in enumerate(records):
        if isinstance(rec, tuple):
            bad[i] = rec
            continue
        try:
            row = {s.name: _value(rec, s) for s in specs}
        except _BadValue as exc:
            bad[i] = (exc.rule, str(exc))
            continue
        rows.append(i)
        for name, v in row.items():
            values[name].append(v)
    tensors = {}
    for s in specs:
        if s.datatype == "BYTES":
            arr = np.empty(len(rows), dtype=object)
            arr[:] = values[s.name]
        else:
            arr = np.asarray(values[s.name], dtype=np_dtype(s.datatype))
        tensors[s.name] = arr.reshape(len(rows), *s.dims)
    return Encoded(np.asarray(rows, dtype=np.int64), tensors, bad)


class _BadValue(ValueError):
    def __init__(self, rule: str, message: str):
        super().__init__(message)
        self.rule = rule


def _value(rec: dict[str, Any], s: InputSpec) -> Any:
    if s.column not in rec or rec[s.column] is None or rec[s.column] == "":
        raise _BadValue("missing", f"input '{s.name}': column '{s.column}' is missing or empty")
    v = rec[s.column]
    if s.datatype == "BYTES":
        return v.encode("utf-8") if isinstance(v, str) else json.dumps(v).encode()
    if isinstance(v, str):  # CSV: a number, or a JSON array
        try:
            v = json.loads(v)
        except ValueError:
            raise _BadValue("type", f"input '{s.name}': column '{s.column}' holds {v[:40]!r}, "
                                    f"not a number or a JSON array") from None
    try:
        arr = np.asarray(v, dtype=np.float64)
    except (TypeError, ValueError):
        raise _BadValue("type", f"input '{s.name}': column '{s.column}' is not numeric") from None
    if arr.size != s.count:
        raise _BadValue("shape", f"input '{s.name}': {arr.size} values, the model takes {dims_text(s)} = {s.count} per row")
    return arr.reshape(s.dims)


def _encode_arrow(batch: Any, n: int, specs: tuple[InputSpec, ...]) -> Encoded:
    """A Parquet record batch, column by column (no per-row Python on the good path)."""
    ok = np.ones(n, dtype=bool)
    bad: dict[int, tuple[str, str]] = {}
    parts: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for s in specs:
        col = batch.column(batch.schema.get_field_index(s.column))
        good, data, why = _arrow_column(col, s, n)
        for i in np.flatnonzero(~good):
            bad.setdefault(int(i), why(int(i)))
        ok &= good
        parts[s.name] = (good, data)
    rows = np.flatnonzero(ok)
    tensors = {name: data[ok[good]] for name, (good, data) in parts.items()}
    return Encoded(rows.astype(np.int64), tensors, bad)


def _arrow_column(col: Any, s: InputSpec, n: int) -> tuple[np.ndarray, np.ndarray, Callable[[int], tuple[str, str]]]:
    import pyarrow as pa  # noqa: PLC0415 - defers a heavy import
    import pyarrow.compute as pc  # noqa: PLC0415 - defers a heavy import

    valid = ~np.asarray(col.is_null().to_numpy(zero_copy_only=False), dtype=bool)
    missing = ("missing", f"input '{s.name}': column '{s.column}' is null")
    t = col.type
    if s.datatype == "BYTES":
        if not (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t)
                or pa.types.is_large_binary(t)):
            raise BatchError(f"column '{s.column}' ({t}) cannot feed input '{s.name}' (BYTES): "
                             "it needs a string or binary column")
        data = col.filter(pa.array(valid)).to_numpy(zero_copy_only=False).astype(object)
        return valid, data.reshape(len(data), *s.dims), lambda _i: missing
    if pa.types.is_integer(t) or pa.types.is_floating(t):
        if s.count != 1:
            raise BatchError(f"column '{s.column}' ({t}) holds one number a row; input '{s.name}' takes "
                             f"{dims_text(s)} = {s.count}: map a list column")
        data = col.filter(pa.array(valid)).to_numpy(zero_copy_only=False).astype(np_dtype(s.datatype))
        return valid, data.reshape(len(data), *s.dims), lambda _i: missing
    if not (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)):
        raise BatchError(f"column '{s.column}' ({t}) cannot feed input '{s.name}' ({s.datatype}): "
                         "it needs a list of numbers")
    values, row_of = col, np.arange(n)
    while pa.types.is_list(values.type) or pa.types.is_large_list(values.type) or pa.types.is_fixed_size_list(values.type):
        parent = pc.list_parent_indices(values).to_numpy()
        row_of = row_of[parent]
        values = pc.list_flatten(values)
    if not (pa.types.is_integer(values.type) or pa.types.is_floating(values.type)):
        raise BatchError(f"column '{s.column}' ({t}) cannot feed input '{s.name}': its values are not numbers")
    counts = np.bincount(row_of, minlength=n)
    good = valid & (counts == s.count)
    leaves = values.to_numpy(zero_copy_only=False).astype(np_dtype(s.datatype))  # a null leaf: NaN
    data = leaves[good[row_of]].reshape(int(good.sum()), *s.dims)

    def why(i: int) -> tuple[str, str]:
        if not valid[i]:
            return missing
        return ("shape", f"input '{s.name}': {counts[i]} values, the model takes {dims_text(s)} = {s.count} per row")

    return good, data, why
