"""``python -m exporter``: export models into a Triton model repository behind a guard, and roll
them out.

Planes, each importing only those below it (``tests/unit/test_architecture.py``)::

    cli                       the Typer app and one module per command
      -> rollout, tune, batch route, controller, gates, judge, reconcile; tuning; offline scoring
        -> build              sources, export, goldens, evaluation, layout, compile
          -> records          the MLflow registry and its history, rollout progress
            -> errors         ExporterError, the root of every exporter error

From tritonguard the exporter imports every plane under the serving stack, and of the guard only
its contract (:mod:`tritonguard.guard.config`).
"""
