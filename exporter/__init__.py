"""``python -m exporter``: export models into a Triton model repository behind a guard.

Library first: :func:`exporter.export.export` / :func:`exporter.export.export_source` do the
work; :mod:`exporter.cli` is a thin Typer layer over them.
"""
