"""Records: the MLflow model registry with its hash-chained history (:mod:`.registry`) and a
rollout's progress document (:mod:`.progress`).

May import: errors; tritonguard's lower planes.
"""
