"""Why an export (or a compile's write) stopped with nothing written: :class:`ExportError`, and
its kinds :class:`DuplicateArtifact` (the same artifact is already a version) and
:class:`GoldenCheckFailed` (the artifact does not compute what the source model computes).
"""

from __future__ import annotations

from pathlib import Path

from exporter.build.goldens import GoldenReport
from exporter.errors import ExporterError


class ExportError(ExporterError):
    """The export cannot proceed; nothing was written to the repository."""


class DuplicateArtifact(ExportError):
    """The new artifact is byte-identical (same sha256) to an existing version of the model:
    refused unless the export is forced; nothing was written."""

    def __init__(self, name: str, version: int, sha256: str, where: Path):
        self.name, self.version, self.sha256 = name, version, sha256
        super().__init__(f"{name} v{version} already holds this artifact (sha256 {sha256[:16]}…, {where}): "
                         f"nothing new to export. Use v{version}, or export again with --force "
                         f"(force=True) to add it as a new version judged by equivalence")


class GoldenCheckFailed(ExportError):
    def __init__(self, report: GoldenReport):
        self.report = report
        where = f" at batch {report.batch}" if report.batch is not None else ""
        if report.error:  # NaN/Inf, a shape mismatch: the figures would only say nan
            what = f": {report.error}"
        else:
            what = " (" + ", ".join(f"{k}={_fmt(v)}" for k, v in report.metrics.items()) + ")"
        super().__init__(f"golden check FAILED{where} on {report.n} samples{what}; nothing was written")


def _fmt(v) -> str:
    return f"{v:.6g}" if isinstance(v, float) else str(v)
