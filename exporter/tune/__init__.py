"""``exporter tune``: sweeping guard and target serving knobs together on a private server.

May import: build, records, errors; tritonguard's lower planes (ops, to start servers).
"""
