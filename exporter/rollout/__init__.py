"""Rollouts: routing changes (:mod:`.route`), the progressive rollout controller (:mod:`.controller`)
and its gates (:mod:`.gates`), the offline judges (:mod:`.judge`, :mod:`.generation`), what the
exporter reads of a guard (:mod:`.guards`), the registry following the routing (:mod:`.reconcile`),
and the servers it loads versions on (:mod:`.serving`).

May import: build, records, errors; tritonguard's lower planes.
"""
