"""Offline batch scoring through a guarded model, on Ray Data (``python -m exporter batch``).

The input (Parquet, JSONL or CSV files) is cut into deterministic blocks: a Parquet row group
sliced into ``block_rows`` pieces, or ``block_rows`` records of a text file found by one
streaming scan. Ray Data schedules the pending blocks on an actor pool; each actor reads its
block, sends it through the guard over gRPC and commits it as one Parquet file named by the
block, with an atomic rename (its rejects first, in the dead-letter folder). A committed file
is the checkpoint: a re-run of the same command skips those blocks, so a job killed at any
point and resumed holds every input row exactly once (``verify`` checks the row ids).
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import logging
import os
import random
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from exporter.errors import ExporterError
from tritonguard.core.files import atomic_path, atomic_write

log = logging.getLogger(__name__)

SERVED_BY = "SERVED_BY"
MANIFEST = "_batch.json"
DEAD_LETTER = "_dead_letter"
FORMATS = {".parquet": "parquet", ".pq": "parquet", ".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv"}
# transient: the job slows down and retries (quota 503s, a restarting server, a model loading)
RETRYABLE = {"StatusCode.UNAVAILABLE", "StatusCode.RESOURCE_EXHAUSTED", "StatusCode.DEADLINE_EXCEEDED",
             "StatusCode.ABORTED", "StatusCode.NOT_FOUND", "StatusCode.CANCELLED"}
REJECTED = {"StatusCode.INVALID_ARGUMENT", "StatusCode.OUT_OF_RANGE", "StatusCode.FAILED_PRECONDITION"}
INTERNAL_ATTEMPTS = 3  # an INTERNAL answer is retried this often before the rows are bisected
_RETRY_AFTER = re.compile(r"retry after (\d+) ms")
_RULE = re.compile(r"violates (\w+)")


def np_dtype(datatype: str) -> Any:
    """The numpy type of a KServe datatype (tritonclient's table), or None for one batch scoring
    cannot send: BF16 has no numpy type (tritonclient maps it to float32)."""
    from tritonclient.utils import triton_to_np_dtype  # noqa: PLC0415

    return None if datatype == "BF16" else triton_to_np_dtype(datatype)


class BatchError(ExporterError):
    """A job that cannot run or go on (bad arguments, a changed input, servers gone too long)."""


# -- the job's description -------------------------------------------------------------------

@dataclass(frozen=True)
class InputSpec:
    """One model input: its column, datatype and per-row shape (batch dimension excluded)."""

    name: str
    column: str
    datatype: str
    dims: tuple[int, ...]

    @property
    def count(self) -> int:
        return int(np.prod(self.dims)) if self.dims else 1


@dataclass(frozen=True)
class OutputSpec:
    name: str
    datatype: str
    dims: tuple[int, ...]


@dataclass(frozen=True)
class Block:
    """A slice of one input file: rows ``first_row`` .. ``first_row + rows`` of the job."""

    id: int
    path: str
    kind: str
    first_row: int
    rows: int
    source_row: int  # first row inside its file
    row_group: int = -1  # parquet
    start: int = 0  # jsonl / csv: byte range
    end: int = 0


@dataclass(frozen=True)
class Job:
    model: str
    inputs: tuple[InputSpec, ...]
    outputs: tuple[OutputSpec, ...]
    servers: tuple[str, ...]
    output: str
    dead_letter: str
    batch_rows: int
    block_rows: int
    concurrency: int = 4
    tenant: str | None = None
    version: int | None = None
    headers: tuple[tuple[str, str], ...] = ()
    retry_timeout_s: float = 300.0
    csv_header: str = ""  # set when the input is CSV: the header line each block is parsed with


@dataclass
class BlockResult:
    block: int
    rows: int
    scored: int
    rejected: int
    reasons: dict[str, int] = field(default_factory=dict)
    versions: dict[str, int] = field(default_factory=dict)
    started: float = 0.0  # wall clock (time.time), for the job's scoring rate
    finished: float = 0.0


# -- planning --------------------------------------------------------------------------------

def input_files(path: Path) -> list[Path]:
    """The files of ``path`` (a file, or a folder of them in name order) with a known format."""
    if path.is_file():
        if path.suffix.lower() not in FORMATS:
            raise BatchError(f"--input {path}: unknown format {path.suffix!r}; use one of "
                             f"{', '.join(sorted(FORMATS))}")
        return [path]
    if not path.is_dir():
        raise BatchError(f"--input {path}: no such file or folder")
    files = sorted(p for p in path.iterdir() if p.suffix.lower() in FORMATS and not p.name.startswith((".", "_")))
    if not files:
        raise BatchError(f"--input {path}: no {', '.join(sorted(FORMATS))} files in the folder")
    if len({FORMATS[p.suffix.lower()] for p in files}) > 1:
        raise BatchError(f"--input {path}: mixes formats; put one format in a folder")
    return files


def plan_blocks(files: list[Path], block_rows: int) -> list[Block]:
    """Deterministic blocks over ``files``: the same files always give the same blocks, which
    is what lets a resumed job skip the committed ones."""
    blocks: list[Block] = []
    row = 0
    for path in files:
        kind = FORMATS[path.suffix.lower()]
        for b in (_parquet_slices(path, block_rows) if kind == "parquet" else _text_slices(path, kind, block_rows)):
            blocks.append(Block(id=len(blocks), path=str(path), kind=kind, first_row=row, **b))
            row += b["rows"]
    return blocks


def _parquet_slices(path: Path, block_rows: int) -> Iterator[dict[str, int]]:
    import pyarrow.parquet as pq  # noqa: PLC0415

    meta = pq.ParquetFile(path).metadata
    source_row = 0
    for g in range(meta.num_row_groups):
        n = meta.row_group(g).num_rows
        for skip in range(0, n, block_rows):
            rows = min(block_rows, n - skip)
            yield {"rows": rows, "source_row": source_row + skip, "row_group": g, "start": skip}
        source_row += n


def _text_slices(path: Path, kind: str, block_rows: int) -> Iterator[dict[str, int]]:
    """Byte ranges of ``block_rows`` records each. JSONL: one record a non-blank line. CSV: a
    record ends at a newline outside quotes (an even count of quote characters so far)."""
    with open(path, "rb") as fh:
        offset = 0
        if kind == "csv":
            offset = len(fh.readline())  # the header
        start, rows, source_row, quotes = offset, 0, 0, 0
        for line in fh:
            offset += len(line)
            if kind == "csv":
                quotes += line.count(b'"')
                if quotes % 2:
                    continue  # a newline inside a quoted field
                quotes = 0
            if not line.strip():
                if rows == 0:
                    start = offset
                continue
            rows += 1
            if rows == block_rows:
                yield {"rows": rows, "source_row": source_row, "start": start, "end": offset}
                source_row += rows
                start, rows = offset, 0
        if rows:
            yield {"rows": rows, "source_row": source_row, "start": start, "end": offset}


def csv_header(path: Path) -> str:
    with open(path, "rb") as fh:
        return fh.readline().decode("utf-8", errors="replace")


def fingerprint(files: list[Path], job: Job, blocks: list[Block]) -> dict[str, Any]:
    """What a resumed job must share with the one that wrote the output: the same input files
    (size and mtime), model, mapping, blocks and pinned version. Servers and tenant may change."""
    return {"format": 1, "model": job.model, "version": job.version,
            "inputs": [{"path": str(p.resolve()), "size": p.stat().st_size, "mtime_ns": p.stat().st_mtime_ns}
                       for p in files],
            "mapping": {s.name: s.column for s in job.inputs}, "block_rows": job.block_rows,
            "blocks": len(blocks), "rows": sum(b.rows for b in blocks)}


def open_output(out: Path, dead: Path, stamp: dict[str, Any], restart: bool) -> None:
    """Create the output folders, or check that they hold this very job; leftovers of an
    attempt killed mid-write (hidden temporary files) are removed."""
    manifest = out / MANIFEST
    if manifest.exists():
        old = json.loads(manifest.read_text())
        if old != stamp and not restart:
            diff = sorted(k for k in stamp if old.get(k) != stamp[k])
            raise BatchError(f"--output {out} holds another job (different {', '.join(diff)}); "
                             "use another --output, or --restart to score it again from scratch")
        if old != stamp:
            for folder in (out, dead):
                for p in folder.glob("part-*.parquet"):
                    p.unlink()
    elif out.exists() and any(out.glob("part-*.parquet")):
        raise BatchError(f"--output {out} holds Parquet parts of no batch job; use another --output")
    out.mkdir(parents=True, exist_ok=True)
    dead.mkdir(parents=True, exist_ok=True)
    for folder in (out, dead):
        for tmp in folder.glob(".part-*.tmp"):
            tmp.unlink(missing_ok=True)
    atomic_write(manifest, json.dumps(stamp, indent=2))


def part_name(block: int) -> str:
    return f"part-{block:06d}.parquet"


def committed(out: Path) -> set[int]:
    return {int(p.name[5:11]) for p in out.glob("part-*.parquet")}


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
    import pyarrow.parquet as pq  # noqa: PLC0415

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
        raise _BadValue("shape", f"input '{s.name}': {arr.size} values, the model takes {_dims(s)} = {s.count} per row")
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
    import pyarrow as pa  # noqa: PLC0415
    import pyarrow.compute as pc  # noqa: PLC0415

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
                             f"{_dims(s)} = {s.count}: map a list column")
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
        return ("shape", f"input '{s.name}': {counts[i]} values, the model takes {_dims(s)} = {s.count} per row")

    return good, data, why


def _dims(s: InputSpec) -> str:
    return "×".join(map(str, s.dims)) or "1"


# -- sending ---------------------------------------------------------------------------------

class Scorer:
    """Sends a block's rows through the guard: requests of ``batch_rows``, round-robin over the
    servers, ``concurrency`` in flight per server. A rejected request is bisected until the
    rejected rows stand alone; transient errors are retried with backoff and full jitter."""

    def __init__(self, job: Job, sleep: Callable[[float], None] = time.sleep):
        import tritonclient.grpc as grpcclient  # noqa: PLC0415

        self.job, self.sleep = job, sleep
        self.grpc = grpcclient
        self.clients = [grpcclient.InferenceServerClient(url) for url in job.servers]
        self._next = itertools.cycle(range(len(self.clients)))
        self._lock = threading.Lock()
        self.pool = ThreadPoolExecutor(max_workers=job.concurrency * len(self.clients), thread_name_prefix="batch")
        self.params: dict[str, Any] = {}
        if job.tenant:
            self.params["tenant"] = job.tenant
        if job.version is not None:
            # the guard answers with this version only (no fallback), or fails the request
            self.params["version"] = job.version
        self.headers = dict(job.headers) or None

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        for c in self.clients:
            c.close()

    def score(self, tensors: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], np.ndarray, dict[int, tuple[str, str]]]:
        """Outputs and SERVED_BY (bytes) of the rows that were served (in row order), and the
        rejected rows (index into ``tensors``) with (rule, message)."""
        n = len(next(iter(tensors.values()))) if tensors else 0
        step = self.job.batch_rows
        futures = [self.pool.submit(self._range, tensors, lo, min(lo + step, n)) for lo in range(0, n, step)]
        outs: dict[str, list[np.ndarray]] = {o.name: [] for o in self.job.outputs}
        served: list[np.ndarray] = []
        bad: dict[int, tuple[str, str]] = {}
        for f in futures:
            for lo, _hi, result in f.result():
                if isinstance(result, tuple):
                    bad[lo] = result
                    continue
                for o in self.job.outputs:
                    outs[o.name].append(result[o.name])
                served.append(result[SERVED_BY])
        empty = {o.name: np.empty((0, *o.dims), dtype=np_dtype(o.datatype) or object) for o in self.job.outputs}
        by = np.concatenate(served) if served else np.empty(0, dtype=object)
        return {o: np.concatenate(v) if v else empty[o] for o, v in outs.items()}, by, bad

    def _range(self, tensors: dict[str, np.ndarray], lo: int, hi: int) -> list[tuple[int, int, Any]]:
        """[lo, hi) as one request, or bisected while the guard rejects it."""
        try:
            return [(lo, hi, self._infer({k: v[lo:hi] for k, v in tensors.items()}))]
        except _Rejected as exc:
            if hi - lo == 1:
                return [(lo, hi, (exc.rule, exc.message))]
        mid = (lo + hi) // 2
        return self._range(tensors, lo, mid) + self._range(tensors, mid, hi)

    def _client(self) -> Any:
        with self._lock:
            return self.clients[next(self._next)]

    def _infer(self, tensors: dict[str, np.ndarray]) -> dict[str, Any]:
        g = self.grpc
        inputs = []
        for s in self.job.inputs:
            x = tensors[s.name]
            inp = g.InferInput(s.name, list(x.shape), s.datatype)
            inp.set_data_from_numpy(x)
            inputs.append(inp)
        outputs = [g.InferRequestedOutput(o) for o in (*(o.name for o in self.job.outputs), SERVED_BY)]
        started, attempt, internal = time.monotonic(), 0, 0
        while True:
            client = self._client()
            try:
                res = client.infer(self.job.model, inputs, outputs=outputs, headers=self.headers,
                                   parameters=self.params or None)
            except g.InferenceServerException as exc:
                code = str(exc.status())
                if code in REJECTED:
                    raise _Rejected(exc.message()) from None
                if self.job.version is not None and "is not routed here" in (exc.message() or ""):
                    raise BatchError(f"--version {self.job.version}: {exc.message()}; route that version "
                                     "(exporter route) or drop --version") from None
                if code == "StatusCode.INTERNAL" and internal < INTERNAL_ATTEMPTS - 1:
                    internal += 1
                elif code == "StatusCode.INTERNAL":
                    raise _Rejected(exc.message(), rule="internal") from None
                elif code not in RETRYABLE:
                    raise BatchError(f"{self.job.model}: {code} {exc.message()}") from None
                waited = time.monotonic() - started
                if waited > self.job.retry_timeout_s:
                    raise BatchError(f"{self.job.model}: no answer for {waited:.0f} s (--retry-timeout); "
                                     f"last: {code} {exc.message()}") from None
                self.sleep(_backoff(attempt, exc.message()))
                attempt += 1
                continue
            served = res.as_numpy(SERVED_BY).reshape(-1)
            if self.job.version is not None and any(version_of(s.decode()) != self.job.version for s in set(served)):
                # the guard pins; another answer is a response-cache hit (the primary's answers)
                raise BatchError(f"--version {self.job.version}: {self.job.model} answered from "
                                 f"{sorted(s.decode() for s in set(served))}; turn the guard's response cache "
                                 "off to score with a version other than the primary")
            return {**{o.name: res.as_numpy(o.name) for o in self.job.outputs}, SERVED_BY: served}


class _Rejected(Exception):
    def __init__(self, message: str, rule: str | None = None):
        super().__init__(message)
        self.message = message
        m = _RULE.search(message)
        self.rule = rule or (m.group(1) if m else "invalid_argument")


def _backoff(attempt: int, message: str) -> float:
    """Exponential backoff with full jitter (50 ms doubling, capped at 5 s), never shorter than
    the retry advice a quota gives (``retry after N ms``)."""
    pause = random.uniform(0, min(5.0, 0.05 * 2 ** attempt))
    m = _RETRY_AFTER.search(message or "")
    return max(pause, int(m.group(1)) / 1000) if m else pause


def version_of(served_by: str) -> int | None:
    """``digits_raw:2`` and ``cache:digits_raw:2`` -> 2; a default answer -> None."""
    tail = served_by.rsplit(":", 1)[-1]
    return int(tail) if tail.isdigit() else None


# -- one block, end to end -------------------------------------------------------------------

def run_block(block: Block, job: Job, scorer: Scorer) -> BlockResult:
    """Read, score and commit one block: its rejects first, then its outputs, each by an atomic
    rename; the output file is the checkpoint."""
    import pyarrow as pa  # noqa: PLC0415

    started = time.time()
    enc = read_block(block, job)
    outs, served, rejected = scorer.score(enc.tensors)
    bad = dict(enc.bad)
    for i, why in rejected.items():
        bad[int(enc.rows[i])] = why
    keep = np.ones(len(enc.rows), dtype=bool)
    keep[list(rejected)] = False
    rows = enc.rows[keep]
    table = pa.table({"row_id": pa.array(rows + block.first_row, pa.int64()),
                      **{o.name: _arrow_tensor(outs[o.name]) for o in job.outputs},
                      **_served_columns(served)})
    if bad:
        idx = np.array(sorted(bad), dtype=np.int64)
        dead = pa.table({"row_id": pa.array(idx + block.first_row, pa.int64()),
                         "reason": [bad[i][0] for i in idx], "message": [bad[i][1] for i in idx],
                         "source": [block.path] * len(idx),
                         "source_row": pa.array(idx + block.source_row, pa.int64())})
        _write_parquet(dead, Path(job.dead_letter) / part_name(block.id))
    _write_parquet(table, Path(job.output) / part_name(block.id))
    return BlockResult(block=block.id, rows=block.rows, scored=len(rows), rejected=len(bad),
                       reasons=dict(Counter(b[0] for b in bad.values())),
                       versions=_counts(table.column("served_by")), started=started, finished=time.time())


def _served_columns(served: np.ndarray) -> dict[str, Any]:
    """``served_by`` and ``version`` per row, computed once per distinct SERVED_BY value."""
    import pyarrow as pa  # noqa: PLC0415

    labels, inverse = np.unique(served, return_inverse=True) if len(served) else (np.empty(0, object), np.empty(0, int))
    names = [x.decode() for x in labels]
    idx = pa.array(inverse.astype(np.int32))
    return {"served_by": pa.array(names, pa.string()).take(idx),
            "version": pa.array([version_of(x) for x in names], pa.int32()).take(idx)}


def _arrow_tensor(x: np.ndarray) -> Any:
    import pyarrow as pa  # noqa: PLC0415

    if x.dtype == object:
        return pa.array(x.reshape(len(x), -1)[:, 0] if x.ndim > 1 else x, pa.binary())
    per_row = int(np.prod(x.shape[1:])) if x.ndim > 1 else 1
    return pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), per_row)


def _write_parquet(table: Any, path: Path) -> None:
    import pyarrow.parquet as pq  # noqa: PLC0415

    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)


class BlockWorker:
    """The Ray Data actor: one Scorer (gRPC clients, thread pool) for every block it is given."""

    def __init__(self, job: Job):
        self.job = job
        self.scorer = Scorer(job)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list[Any]]:
        results = [run_block(Block(**json.loads(b)), self.job, self.scorer) for b in batch["block"]]
        return {"result": [json.dumps(asdict(r)) for r in results]}


# -- the job ---------------------------------------------------------------------------------

def model_specs(server: str, model: str,
                mapping: dict[str, str]) -> tuple[tuple[InputSpec, ...], tuple[OutputSpec, ...], int]:
    """Inputs (with their columns), outputs and max batch size of ``model`` as ``server``
    serves it. A mapping that names no input of the model is an error naming it."""
    import tritonclient.grpc as grpcclient  # noqa: PLC0415

    with grpcclient.InferenceServerClient(server) as c:
        try:
            meta = c.get_model_metadata(model, as_json=True)
            cfg = c.get_model_config(model, as_json=True)["config"]
        except grpcclient.InferenceServerException as exc:
            raise BatchError(f"--server {server}: model {model!r}: {exc.message()}") from None
    batched = int(cfg.get("max_batch_size", 0)) > 0
    if not batched:
        raise BatchError(f"{model}: max_batch_size is 0; batch scoring needs a batching model")
    names = [i["name"] for i in meta["inputs"]]
    if unknown := sorted(set(mapping) - set(names)):
        raise BatchError(f"--map {unknown[0]}=…: {model} has no input {unknown[0]!r} (inputs: {', '.join(names)})")
    specs = tuple(InputSpec(i["name"], mapping.get(i["name"], i["name"]), i["datatype"],
                            tuple(int(d) for d in i["shape"][1:])) for i in meta["inputs"])
    for s in specs:
        if any(d < 0 for d in s.dims):
            raise BatchError(f"input '{s.name}' has a variable shape {list(s.dims)}; batch scoring needs fixed dims")
        if s.datatype == "BYTES" and s.count != 1:
            raise BatchError(f"input '{s.name}' takes {_dims(s)} strings a row; batch scoring sends one")
        if s.datatype != "BYTES" and np_dtype(s.datatype) is None:
            raise BatchError(f"input '{s.name}' has datatype {s.datatype}, which batch scoring does not send")
    outputs = tuple(OutputSpec(o["name"], o["datatype"], tuple(int(d) for d in o["shape"][1:]))
                    for o in meta["outputs"] if o["name"] != SERVED_BY)
    if SERVED_BY not in {o["name"] for o in meta["outputs"]}:
        raise BatchError(f"{model} has no {SERVED_BY} output: batch scoring goes through a guarded model")
    return specs, outputs, int(cfg["max_batch_size"])


def resolve_columns(files: list[Path], specs: tuple[InputSpec, ...], header: str,
                    mapped: dict[str, str]) -> tuple[InputSpec, ...]:
    """Every input's column, checked against the Parquet schema or the CSV header (JSONL is
    checked per record): a mapped column must exist; an unmapped input reads the column of its
    own name, or the one column whose name differs from it in case only (``IMAGE`` <- ``image``)."""
    kind = FORMATS[files[0].suffix.lower()]
    if kind == "jsonl":
        return specs
    if kind == "parquet":
        import pyarrow.parquet as pq  # noqa: PLC0415

        schemas = [(str(p), pq.ParquetFile(p).schema_arrow.names) for p in files]
    else:
        schemas = [("the CSV header", next(csv.reader([header])))]
    resolved = []
    for s in specs:
        column = s.column
        for where, names in schemas:
            if column not in names and s.name not in mapped:
                folded = [n for n in names if n.lower() == s.name.lower()]
                column = folded[0] if len(folded) == 1 else column
            if column not in names:
                raise BatchError(f"input '{s.name}': {where} has no column {column!r} "
                                 f"(columns: {', '.join(names)}); map one with --map {s.name}=COLUMN")
        resolved.append(InputSpec(s.name, column, s.datatype, s.dims))
    return tuple(resolved)


def run_job(job: Job, blocks: list[Block], *, workers: int, ray_address: str | None,
            on_block: Callable[[BlockResult], None]) -> None:
    """Score ``blocks`` on Ray Data: an actor pool of ``workers`` BlockWorkers, two blocks in
    flight per actor so one is read and written while the other is being served."""
    try:
        import ray  # noqa: PLC0415
    except ImportError:
        raise BatchError("exporter batch runs on Ray Data, which is not installed: "
                         "pip install 'tritonguard[batch]' (make setup installs it)") from None

    if not ray.is_initialized():
        quiet = {"log_to_driver": False, "configure_logging": True, "logging_level": logging.ERROR}
        if ray_address:
            ray.init(address=ray_address, **quiet)
        else:
            # the raylet waits this long for its agents: 30 s by default, which a loaded
            # machine (the model server beside the job) can exceed
            os.environ.setdefault("RAY_agent_register_timeout_ms", "180000")
            ray.init(include_dashboard=False, object_store_memory=128 * 1024 * 1024, **quiet)
    import ray.data  # noqa: PLC0415

    for name in ("ray", "ray.data"):
        logging.getLogger(name).setLevel(logging.ERROR)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    ds = ray.data.from_items([{"block": json.dumps(asdict(b))} for b in blocks], override_num_blocks=len(blocks))
    pool = ray.data.ActorPoolStrategy(size=workers, max_concurrent_calls_per_actor=2, enable_true_multi_threading=True)
    ds = ds.map_batches(_bound_worker(job), batch_size=1, compute=pool, num_cpus=0.25)
    for row in ds.iter_rows():
        on_block(BlockResult(**json.loads(row["result"])))


def _bound_worker(job: Job) -> type:
    """BlockWorker with ``job`` in its class (pickled with it) rather than in constructor
    arguments, which Ray would keep in the object store for actor restarts."""

    class Worker(BlockWorker):
        def __init__(self) -> None:
            super().__init__(job)

    return Worker


def summary(out: Path, dead: Path, total_rows: int) -> dict[str, Any]:
    """Figures read back from the committed files, and the exactly-once check: the row ids of
    outputs and dead letters together are 0 .. rows-1, each once."""
    import pyarrow.dataset as pads  # noqa: PLC0415

    def column(folder: Path, name: str) -> Any:
        files = sorted(folder.glob("part-*.parquet"))
        return pads.dataset(files, format="parquet").to_table(columns=[name]).column(name) if files else None

    ids = [c.to_numpy() for c in (column(out, "row_id"), column(dead, "row_id")) if c is not None]
    all_ids = np.sort(np.concatenate(ids)) if ids else np.empty(0, dtype=np.int64)
    exact = len(all_ids) == total_rows and bool(np.array_equal(all_ids, np.arange(total_rows)))
    served = column(out, "served_by")
    reasons = column(dead, "reason")
    return {
        "rows": total_rows,
        "scored": 0 if served is None else len(served),
        "rejected": 0 if reasons is None else len(reasons),
        "rejects_by_reason": {} if reasons is None else _counts(reasons),
        "served_by": {} if served is None else _counts(served),
        "exactly_once": exact,
        "missing_rows": int(total_rows - len(np.unique(all_ids))),
        "duplicate_rows": int(len(all_ids) - len(np.unique(all_ids))),
    }


def _counts(column: Any) -> dict[str, int]:
    vc = column.value_counts()
    return {str(v["values"]): int(v["counts"]) for v in vc.to_pylist()}


def parse_mapping(pairs: list[str]) -> dict[str, str]:
    mapping: dict[str, str] = {}
    for pair in pairs:
        name, sep, column = pair.partition("=")
        if not sep or not name or not column:
            raise BatchError(f"--map {pair!r}: expected INPUT=COLUMN, e.g. --map TEXT=sentence")
        mapping[name] = column
    return mapping


def parse_headers(pairs: list[str]) -> tuple[tuple[str, str], ...]:
    out = []
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise BatchError(f"--header {pair.split('=')[0]!r}…: expected NAME=VALUE")
        out.append((name.strip().lower(), value))  # gRPC metadata keys are lower-case
    return tuple(out)


__all__ = ["BatchError", "Block", "BlockResult", "Job", "InputSpec", "plan_blocks", "run_job", "summary"]
