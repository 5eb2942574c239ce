"""The command line: the Typer app (:mod:`.app`) and a module per command group (``*_cmd``),
plus the views (status, watch) and the consoles. Each command calls a library function and
catches :class:`exporter.errors.ExporterError`.

May import: every exporter plane, tritonguard's lower planes.
"""
