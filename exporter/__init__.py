"""``python -m exporter``: export models into a Triton model repository behind a guard.

Library first: :func:`exporter.build.export.export` / :func:`exporter.build.export.export_source` do the
work; :mod:`exporter.cli.app` is a thin Typer layer over them.
"""
