"""Building versions: sources (:mod:`.sources`), export with goldens and evaluation sets
(:mod:`.export`, :mod:`.goldens`, :mod:`.evaluate`, :mod:`.artifacts`), the repository layout
(:mod:`.layout`) and compiled variants (:mod:`.compile`).

May import: records, errors; tritonguard's lower planes.
"""
