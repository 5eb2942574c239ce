"""Checking an audit log: :func:`verify` and its :class:`VerifyResult` (``exporter audit verify``).

Every hash, ``prev`` link and ``seq`` of the chain is checked, oldest rotated file first, then the
chain against its anchors (:mod:`tritonguard.privacy.audit.anchors`): a chain shorter than an
anchor, or one whose anchored head is not in it, is truncated, and so is one that holds a
``truncation`` record the writer left; ``gap`` records (records the writer lost) are listed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tritonguard.privacy.audit.anchors import (
    AnchorStore,
    anchor_name,
    anchor_where,
    local_anchor_path,
    read_anchors,
)
from tritonguard.privacy.audit.chain import (
    GAP,
    GENESIS,
    TRUNCATION,
    plural,
    record_hash,
    rotated_files,
    utc_iso,
)


@dataclass
class VerifyResult:
    ok: bool
    records: int  # records read, all files together
    first_bad: int | None  # 0-based position of the first bad record in the whole chain (= its seq)
    reason: str
    # ok | unanchored (intact, but no anchor to check the tail against) | gaps | truncated |
    # tampered (a bad record, or a bad anchor) | missing (no log, no anchor)
    status: str = "ok"
    missing: int = 0  # records an anchor counts beyond the end of the log
    gaps: list[dict[str, Any]] = field(default_factory=list)  # the chain's gap records
    truncations: list[str] = field(default_factory=list)  # every truncation found, worded
    anchors: list[dict[str, Any]] = field(default_factory=list)  # anchors found (with "at": where)
    warnings: list[str] = field(default_factory=list)


def verify(path: str | os.PathLike[str], *, anchors: AnchorStore | Sequence[AnchorStore] | None = None,
           key: bytes | None = None, name: str | None = None, allow_gaps: bool = False) -> VerifyResult:
    """Check every hash, ``prev`` link and ``seq`` of the chain, oldest rotated file first, then
    the chain against its anchors (``<path>.anchor`` and ``name`` in each of ``anchors``).

    ``status`` (and ``ok``): ``ok`` (True) intact and anchored; ``unanchored`` (True, with a
    warning) intact, but no anchor was found, so a lost tail cannot be seen; ``gaps`` (True only
    with ``allow_gaps``) intact, but gap records say records were lost; ``truncated`` (False)
    fewer records than an anchor counts, an anchored head not in the chain, or a truncation
    record; ``tampered`` (False) a bad record (``first_bad``) or a bad anchor; ``missing`` (False)
    no log and no anchor.
    """
    stores = [] if anchors is None else [anchors] if not isinstance(anchors, (list, tuple)) else list(anchors)
    files = rotated_files(path)
    found, bad_anchors, warnings = read_anchors(path, stores, name=name, key=key)
    if not files and not found and not bad_anchors:
        return VerifyResult(False, 0, None, f"{path}: no audit log files", status="missing", warnings=warnings)
    heads: dict[int, list[dict[str, Any]]] = {}
    for doc in found:
        if doc["seq"] > 0:
            heads.setdefault(doc["seq"] - 1, []).append(doc)
    expected_prev, pos, bad, reason = GENESIS, 0, None, ""
    gaps: list[dict[str, Any]] = []
    notes: list[dict[str, Any]] = []
    replaced: list[dict[str, Any]] = []
    for p in files:
        with open(p, "rb") as f:
            for lineno, line in enumerate(f, 1):
                if bad is None:
                    problem = _check(line, pos, expected_prev)
                    if problem:
                        bad, reason = pos, f"{p.name}:{lineno}: {problem}"
                    else:
                        rec = json.loads(line)
                        expected_prev = rec["hash"]
                        if rec.get("type") == GAP:
                            gaps.append(rec)
                        elif rec.get("type") == TRUNCATION:
                            notes.append(rec)
                        replaced += [d for d in heads.get(pos, ()) if d["head"] != expected_prev]
                pos += 1
    result = VerifyResult(True, pos, None, "ok", anchors=found, warnings=warnings,
                          gaps=[{k: g.get(k) for k in ("seq", "ts", "lost", "first_lost_ts", "last_lost_ts", "reasons")}
                                for g in gaps])
    truncations = result.truncations
    for doc in found:
        if doc["seq"] > pos:
            result.missing = max(result.missing, doc["seq"] - pos)
    best = max(found, key=lambda d: d["seq"], default=None)
    if result.missing and best is not None:
        where = (f"after seq {pos - 1}" if pos else "the log is empty" if files else "no log files left")
        sep = " " if pos else ", "
        truncations.append(f"{plural(result.missing, 'record')} missing{sep}{where} (anchor {best['at']}: "
                           f"{plural(best['seq'], 'record')}, head {best['head'][:12]}…, {utc_iso(best['ts'])})")
    for doc in replaced:
        truncations.append(f"the anchored record seq {doc['seq'] - 1} (hash {doc['head'][:12]}…) is not in the chain: "
                           f"records up to it were cut and rewritten (anchor {doc['at']}, {utc_iso(doc['ts'])})")
    for rec in notes:
        truncations.append(f"{rec.get('detail')} (found when writing resumed: truncation record seq {rec.get('seq')}, "
                           f"{utc_iso(rec.get('detected_ts', rec.get('ts')))})")
    gap_text = ""
    if gaps:
        lost = sum(int(g.get("lost") or 0) for g in gaps)
        listed = "; ".join(_gap_text(g) for g in result.gaps[:5]) + ("; …" if len(gaps) > 5 else "")
        gap_text = f"gaps: {plural(lost, 'record')} lost in {plural(len(gaps), 'gap')}: {listed}"
    if bad is not None:
        result.ok, result.first_bad, result.reason, result.status = False, bad, reason, "tampered"
        result.warnings += [f"also truncated: {t}" for t in truncations]
    elif bad_anchors:
        result.ok, result.status, result.reason = False, "tampered", "; ".join(bad_anchors)
    elif truncations:
        result.ok, result.status = False, "truncated"
        result.first_bad = pos if result.missing else None
        result.reason = "truncated: " + "; ".join(truncations)
        if gap_text:
            result.warnings.append(f"also {gap_text}")
    elif gaps:
        result.ok, result.status, result.reason = allow_gaps, "gaps", gap_text
    elif not found:
        result.status = "unanchored"
        looked = [str(local_anchor_path(path)), *(anchor_where(s, name or anchor_name(path)) for s in stores)]
        result.warnings.append(f"unanchored: no anchor found ({', '.join(looked)}); a lost tail cannot be detected")
    return result


def _gap_text(g: dict[str, Any]) -> str:
    why = ", ".join(f"{k} {v}" for k, v in sorted((g.get("reasons") or {}).items()))
    return (f"seq {g.get('seq')}: {g.get('lost')} lost {utc_iso(g.get('first_lost_ts'))} – "
            f"{utc_iso(g.get('last_lost_ts'))}{f' ({why})' if why else ''}")


def _check(line: bytes, pos: int, expected_prev: str) -> str:
    try:
        rec = json.loads(line)
    except ValueError:
        return "not valid JSON"
    if not isinstance(rec, dict) or not isinstance(rec.get("hash"), str):
        return "not an audit record"
    if rec["hash"] != record_hash(rec):
        return f"hash mismatch (record seq {rec.get('seq')} was altered)"
    if rec.get("prev") != expected_prev:
        return f"prev does not match the hash of the record before (seq {rec.get('seq')}; records missing or reordered)"
    if rec.get("seq") != pos:
        return f"seq {rec.get('seq')} where {pos} was expected"
    return ""
