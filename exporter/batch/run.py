"""Running a job: one block end to end (read, score, commit its rejects then its outputs by
atomic renames: the committed file is the checkpoint), the Ray Data actor pool over the pending
blocks, and the summary read back from the committed files (the exactly-once check). pyarrow
and Ray are imported where they are used.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from exporter.batch.encode import read_block
from exporter.batch.job import BatchError, Block, BlockResult, Job, part_name
from exporter.batch.scorer import Scorer, version_of
from tritonguard.core.files import atomic_path

# -- one block, end to end -------------------------------------------------------------------

def run_block(block: Block, job: Job, scorer: Scorer) -> BlockResult:
    """Read, score and commit one block: its rejects first, then its outputs, each by an atomic
    rename; the output file is the checkpoint."""
    import pyarrow as pa  # noqa: PLC0415 - defers a heavy import

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
    import pyarrow as pa  # noqa: PLC0415 - defers a heavy import

    labels, inverse = np.unique(served, return_inverse=True) if len(served) else (np.empty(0, object), np.empty(0, int))
    names = [x.decode() for x in labels]
    idx = pa.array(inverse.astype(np.int32))
    return {"served_by": pa.array(names, pa.string()).take(idx),
            "version": pa.array([version_of(x) for x in names], pa.int32()).take(idx)}


def _arrow_tensor(x: np.ndarray) -> Any:
    import pyarrow as pa  # noqa: PLC0415 - defers a heavy import

    if x.dtype == object:
        return pa.array(x.reshape(len(x), -1)[:, 0] if x.ndim > 1 else x, pa.binary())
    per_row = int(np.prod(x.shape[1:])) if x.ndim > 1 else 1
    return pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), per_row)


def _write_parquet(table: Any, path: Path) -> None:
    import pyarrow.parquet as pq  # noqa: PLC0415 - defers a heavy import

    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)


# Ray Data restarts a dead pool actor forever by default; its actors get their function and
# context as object-store arguments, so each start logged an error-level line (`Actor … has
# constructor arguments in the object store and max_restarts > 0`) on every job. A worker that
# dies stops the run instead: committed blocks stay, and the same command resumes the rest.
WORKER_RESTARTS = 0

ROWS_REPORT_S = 0.5  # how often a worker tells the driver how many rows were answered


class RowsAnswered:
    """Rows answered so far, summed over every worker: the driver's progress moves with the
    answers, not only with committed blocks (a 65,536-row block of text takes minutes). Reports
    are coalesced to one per ``ROWS_REPORT_S`` per worker; ``add`` never blocks the scorer."""

    def __init__(self, report: Callable[[int], Any]):
        self._report, self._pending, self._last = report, 0, time.monotonic()
        self._lock = threading.Lock()

    def add(self, rows: int) -> None:
        with self._lock:
            self._pending += rows
            if time.monotonic() - self._last < ROWS_REPORT_S:
                return
            n, self._pending, self._last = self._pending, 0, time.monotonic()
        self._report(n)

    def flush(self) -> None:
        with self._lock:
            n, self._pending = self._pending, 0
        if n:
            self._report(n)


class BlockWorker:
    """The Ray Data actor: one Scorer (gRPC clients, thread pool) for every block it is given."""

    def __init__(self, job: Job, counter: Any = None):
        self.job = job
        self.rows = RowsAnswered(lambda n: counter.add.remote(n)) if counter is not None else None
        self.scorer = Scorer(job, on_rows=self.rows.add if self.rows else None)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list[Any]]:
        results = [run_block(Block(**json.loads(b)), self.job, self.scorer) for b in batch["block"]]
        if self.rows is not None:
            self.rows.flush()
        return {"result": [json.dumps(asdict(r)) for r in results]}


def run_job(job: Job, blocks: list[Block], *, workers: int, ray_address: str | None,
            on_block: Callable[[BlockResult], None], on_rows: Callable[[int], None] | None = None) -> None:
    """Score ``blocks`` on Ray Data: an actor pool of ``workers`` BlockWorkers, two blocks in
    flight per actor so one is read and written while the other is being served. ``on_rows``
    gets the rows answered so far in this run (committed or not), about twice a second."""
    try:
        import ray  # noqa: PLC0415 - defers a heavy import
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
    import ray.data  # noqa: PLC0415 - defers a heavy import

    for name in ("ray", "ray.data"):
        logging.getLogger(name).setLevel(logging.ERROR)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    ds = ray.data.from_items([{"block": json.dumps(asdict(b))} for b in blocks], override_num_blocks=len(blocks))
    pool = ray.data.ActorPoolStrategy(size=workers, max_concurrent_calls_per_actor=2, enable_true_multi_threading=True)
    counter = ray.remote(num_cpus=0)(_RowCounter).remote() if on_rows is not None else None
    stop = threading.Event()

    def poll() -> None:  # the driver's side: read the counter, never fail the job
        while not stop.wait(ROWS_REPORT_S):
            try:
                on_rows(ray.get(counter.total.remote(), timeout=5))
            except Exception:  # noqa: BLE001, S112 - progress is a view; the next poll tries again
                continue

    poller = threading.Thread(target=poll, name="batch-progress", daemon=True) if counter is not None else None
    with warnings.catch_warnings():  # Ray 2.60 names no other way to pass max_restarts
        warnings.simplefilter("ignore", DeprecationWarning)
        ds = ds.map_batches(_bound_worker(job, counter), batch_size=1, compute=pool, num_cpus=0.25,
                            max_restarts=WORKER_RESTARTS)
    if poller is not None:
        poller.start()
    try:
        for row in ds.iter_rows():
            on_block(BlockResult(**json.loads(row["result"])))
    finally:
        stop.set()
        if poller is not None:
            poller.join(timeout=10)


def _bound_worker(job: Job, counter: Any = None) -> type:
    """BlockWorker with ``job`` in its class (pickled with it) rather than in constructor
    arguments, which Ray would keep in the object store for actor restarts."""

    class Worker(BlockWorker):
        def __init__(self) -> None:
            super().__init__(job, counter)

    return Worker


class _RowCounter:
    """A Ray actor summing the rows the workers answered (works on a cluster as on one host)."""

    def __init__(self) -> None:
        self.n = 0

    def add(self, rows: int) -> None:
        self.n += rows

    def total(self) -> int:
        return self.n


def summary(out: Path, dead: Path, total_rows: int) -> dict[str, Any]:
    """Figures read back from the committed files, and the exactly-once check: the row ids of
    outputs and dead letters together are 0 .. rows-1, each once."""
    import pyarrow.dataset as pads  # noqa: PLC0415 - defers a heavy import

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


__all__ = ["run_job", "summary"]
