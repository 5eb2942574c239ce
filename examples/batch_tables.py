"""Parquet tables to score with ``exporter batch``, generated offline and streamed to disk
(one row group at a time, so a table of any size costs one group's memory).

``python -m examples.batch_tables digits digits.parquet --rows 1000000``: load_digits images
(``image``: 64 floats a row, ``label``), cycled. ``python -m examples.batch_tables sentences
sentences.parquet --rows 100000``: standard-library sentences (``text``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np


def write_digits(path: Path, rows: int, group_rows: int = 65536) -> Path:
    import pyarrow as pa  # noqa: PLC0415
    import pyarrow.parquet as pq  # noqa: PLC0415
    from sklearn.datasets import load_digits  # noqa: PLC0415

    d = load_digits()
    images, labels = d.images.reshape(len(d.images), 64).astype(np.float32), d.target.astype(np.int64)
    schema = pa.schema([("image", pa.list_(pa.float32(), 64)), ("label", pa.int64())])
    with pq.ParquetWriter(path, schema) as w:
        for lo in range(0, rows, group_rows):
            idx = np.arange(lo, min(lo + group_rows, rows)) % len(images)
            w.write_table(pa.table({"image": pa.FixedSizeListArray.from_arrays(pa.array(images[idx].reshape(-1)), 64),
                                    "label": labels[idx]}, schema=schema))
    return path


def write_sentences(path: Path, rows: int, group_rows: int = 65536) -> Path:
    import pyarrow as pa  # noqa: PLC0415
    import pyarrow.parquet as pq  # noqa: PLC0415

    from .texts import stdlib_sentences  # noqa: PLC0415

    base = stdlib_sentences(min(rows, 5000))
    schema = pa.schema([("text", pa.string())])
    with pq.ParquetWriter(path, schema) as w:
        for lo in range(0, rows, group_rows):
            w.write_table(pa.table({"text": [base[i % len(base)] for i in range(lo, min(lo + group_rows, rows))]},
                                   schema=schema))
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("kind", choices=("digits", "sentences"))
    p.add_argument("path", type=Path)
    p.add_argument("--rows", type=int, default=100_000)
    a = p.parse_args()
    (write_digits if a.kind == "digits" else write_sentences)(a.path, a.rows)


if __name__ == "__main__":
    main()
