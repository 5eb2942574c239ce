"""Which version answered which events, compactly: per version (the guard's ``SERVED_BY``, e.g.
``digits_raw:2``) and input partition, the ranges of input offsets whose results the broker
acknowledged. After a rollback, the candidate's ranges are the events to score again through the
primary (``exporter stream --replay``); the record is a small JSON file (``--record``), rewritten
as it changes, and a summary is logged at exit.

Replay specs: a record file, or ``TOPIC:PARTITION:START-END`` (inclusive offsets)."""

from __future__ import annotations

import bisect
import json
import os
import time
from pathlib import Path
from typing import Any

from exporter.stream.offsets import TP

FORMAT = 1
Span = tuple[int, int, str]  # first offset, last offset (inclusive), the version that answered ("": unknown)


class RecordError(ValueError):
    """A replay spec or record file that cannot be read."""


class Answered:
    """Not thread-safe: the stream's loop feeds it from the producer's delivery reports."""

    def __init__(self) -> None:
        self.ranges: dict[str, dict[TP, list[list[int]]]] = {}
        self.counts: dict[str, int] = {}
        self.last: dict[str, float] = {}  # version -> monotonic time of its last acknowledged answer
        self.changed = False

    def add(self, version: str, tp: TP, offset: int) -> None:
        spans = self.ranges.setdefault(version, {}).setdefault(tp, [])
        self.last[version] = time.monotonic()
        self.changed = True
        if not spans or offset > spans[-1][1] + 1:  # the usual case: ascending per partition
            spans.append([offset, offset])
        elif offset == spans[-1][1] + 1:
            spans[-1][1] = offset
        else:  # an event redone after a rebalance: insert and merge
            k = bisect.bisect_right(spans, [offset, offset])
            if k and spans[k - 1][1] >= offset:
                return  # already in
            spans.insert(k, [offset, offset])
            for j in (k, k - 1):
                if 0 <= j < len(spans) - 1 and spans[j][1] + 1 >= spans[j + 1][0]:
                    spans[j][1] = max(spans[j][1], spans.pop(j + 1)[1])
        self.counts[version] = self.counts.get(version, 0) + 1

    def to_dict(self, *, topic: str, model: str, group: str) -> dict[str, Any]:
        return {"format": FORMAT, "topic": topic, "model": model, "group": group, "updated_at": time.time(),
                "answered": {v: {f"{t}:{p}": spans for (t, p), spans in sorted(parts.items())}
                             for v, parts in sorted(self.ranges.items())},
                "events": dict(sorted(self.counts.items()))}

    def write(self, path: Path, **meta: str) -> None:
        """Atomically (a reader never sees half a file)."""
        path = Path(path)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.to_dict(**meta), separators=(",", ":")))
        os.replace(tmp, path)
        self.changed = False

    def summary(self, version: str, limit: int = 8) -> str:
        """``N events in K ranges: events[0] 3-17, ...`` (the first ``limit`` ranges)."""
        parts = self.ranges.get(version, {})
        flat = [f"{t}[{p}] {a}-{b}" if a != b else f"{t}[{p}] {a}" for (t, p), spans in sorted(parts.items())
                for a, b in spans]
        more = f", ... ({len(flat) - limit} more)" if len(flat) > limit else ""
        return f"{self.counts.get(version, 0)} events in {len(flat)} ranges: {', '.join(flat[:limit])}{more}"


def read_specs(specs: list[str], topic: str) -> dict[TP, list[Span]]:
    """What to replay, per input partition: spans of offsets with the version that answered them
    (from a record file) or "" (a ``TOPIC:PARTITION:START-END`` range). Every span is on ``topic``."""
    out: dict[TP, list[Span]] = {}
    for spec in specs:
        if Path(spec).is_file():
            try:
                doc = json.loads(Path(spec).read_text())
                if doc.get("format") != FORMAT:
                    raise RecordError(f"{spec}: not a stream record (format {doc.get('format')!r})")
                for version, parts in doc["answered"].items():
                    for where, spans in parts.items():
                        t, _, p = where.rpartition(":")
                        for a, b in spans:
                            out.setdefault((t, int(p)), []).append((int(a), int(b), str(version)))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                if isinstance(exc, RecordError):
                    raise
                raise RecordError(f"{spec}: not a stream record ({type(exc).__name__}: {exc})") from None
            continue
        t, p, rng = (spec.rsplit(":", 2) + ["", ""])[:3] if spec.count(":") >= 2 else ("", "", "")
        a, sep, b = rng.partition("-")
        if not (t and p.isdigit() and a.isdigit() and (not sep or b.isdigit())):
            raise RecordError(f"--replay {spec!r}: expected a record file or TOPIC:PARTITION:START-END")
        first, last = int(a), int(b) if sep else int(a)
        if last < first:
            raise RecordError(f"--replay {spec!r}: the range ends before it starts")
        out.setdefault((t, int(p)), []).append((first, last, ""))
    for tp in out:
        if tp[0] != topic:
            raise RecordError(f"--replay: {tp[0]}[{tp[1]}] is not on the input topic {topic!r}")
        out[tp].sort()
    return out
