"""XGBoost candidates on iris, one recipe for every host that rolls them out (Triton in
tests/functional/test_classical.py, Ray Serve in tests/functional/test_ray_serve.py):

- :func:`v1`: an ``XGBClassifier`` (25 trees of depth 3) on the even rows;
- :func:`retrain`: a genuine retrain on the same rows (60 trees of depth 2, learning rate 0.2):
  other probabilities, the same labels on the held-out rows;
- :func:`slow`: v1 trained on for 10,000 rounds at learning rate 0: 30,000 more trees whose
  leaves are all 0, so exactly v1's answers at ~16x its model time (onnxruntime, one row: 281
  against 17 us a call, 2.4 MB against 11 KB, 2026-11-30). A latency gate must stop it.

Each is saved with ``save_model`` (JSON) and exported as a user exports a booster:
``exporter export --source iris.json``.
"""

from __future__ import annotations

import numpy as np

SLOW_ROUNDS = 10_000


def data() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(training features, training labels, held-out features as float32): the even rows of
    load_iris train, the 75 odd rows are what no booster was trained on."""
    from sklearn.datasets import load_iris  # noqa: PLC0415

    x, y = load_iris(return_X_y=True)
    return x[::2], y[::2], x[1::2].astype(np.float32)


def v1():
    import xgboost as xgb  # noqa: PLC0415

    x, y, _ = data()
    return xgb.XGBClassifier(n_estimators=25, max_depth=3).fit(x, y)


def retrain():
    import xgboost as xgb  # noqa: PLC0415

    x, y, _ = data()
    return xgb.XGBClassifier(n_estimators=60, max_depth=2, learning_rate=0.2).fit(x, y)


def slow(base):
    """``base`` trained on for :data:`SLOW_ROUNDS` rounds at learning rate 0 (the tests that roll
    it out check that its held-out probabilities are exactly ``base``'s)."""
    import xgboost as xgb  # noqa: PLC0415

    x, y, _ = data()
    return xgb.XGBClassifier(n_estimators=SLOW_ROUNDS, max_depth=3, learning_rate=0.0).fit(
        x, y, xgb_model=base.get_booster())
