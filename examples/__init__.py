"""Example model sources for ``python -m exporter export --source examples.<name>:build``."""
