"""Offline batch scoring through a guarded model, on Ray Data (``python -m exporter batch``).

The input (Parquet, JSONL or CSV files) is cut into deterministic blocks: a Parquet row group
sliced into ``block_rows`` pieces, or ``block_rows`` records of a text file found by one
streaming scan. Ray Data schedules the pending blocks on an actor pool; each actor reads its
block, sends it through the guard over gRPC and commits it as one Parquet file named by the
block, with an atomic rename (its rejects first, in the dead-letter folder). A committed file
is the checkpoint: a re-run of the same command skips those blocks, so a job killed at any
point and resumed holds every input row exactly once (``verify`` checks the row ids).

This module describes a job (its inputs and outputs, the model's specs, the deterministic
blocks, the output folder's manifest); :mod:`exporter.batch.encode` reads and encodes a block,
:mod:`exporter.batch.scorer` sends it through the guard, and :mod:`exporter.batch.run` runs
blocks end to end on Ray Data and reads the summary back.
"""

from __future__ import annotations

import csv
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from exporter.errors import ExporterError
from tritonguard.core.files import atomic_write

log = logging.getLogger(__name__)

SERVED_BY = "SERVED_BY"
MANIFEST = "_batch.json"
DEAD_LETTER = "_dead_letter"
FORMATS = {".parquet": "parquet", ".pq": "parquet", ".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv"}


def np_dtype(datatype: str) -> Any:
    """The numpy type of a KServe datatype (tritonclient's table), or None for one batch scoring
    cannot send: BF16 has no numpy type (tritonclient maps it to float32)."""
    from tritonclient.utils import triton_to_np_dtype  # noqa: PLC0415 - defers a heavy import

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
    import pyarrow.parquet as pq  # noqa: PLC0415 - defers a heavy import

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


def dims_text(s: InputSpec) -> str:
    return "×".join(map(str, s.dims)) or "1"


# -- the job ---------------------------------------------------------------------------------

def model_specs(server: str, model: str,
                mapping: dict[str, str]) -> tuple[tuple[InputSpec, ...], tuple[OutputSpec, ...], int]:
    """Inputs (with their columns), outputs and max batch size of ``model`` as ``server``
    serves it. A mapping that names no input of the model is an error naming it."""
    import tritonclient.grpc as grpcclient  # noqa: PLC0415 - defers a heavy import

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
            raise BatchError(f"input '{s.name}' takes {dims_text(s)} strings a row; batch scoring sends one")
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
        import pyarrow.parquet as pq  # noqa: PLC0415 - defers a heavy import

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


__all__ = ["BatchError", "Block", "BlockResult", "Job", "InputSpec", "plan_blocks"]
