"""``exporter batch``: offline scoring of a table through the guard (Ray Data).

May import: build, records, errors; tritonguard's lower planes.
"""
