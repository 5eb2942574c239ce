import json

import numpy as np
import pytest
from scipy import stats

from tritonguard.core.config import from_params
from tritonguard.core.errors import ConfigError
from tritonguard.rollout.drift import (
    DriftConfig,
    DriftMonitor,
    Ewma,
    ReferenceSummary,
    ks_2samp_rows,
    ks_below,
    ks_p_values,
    text_features,
)


def sequential_ewma(alpha, values, value=None):
    for x in values:
        value = x if value is None else (1 - alpha) * value + alpha * x
    return value


@pytest.fixture(scope="module")
def reference():
    rng = np.random.default_rng(0)
    X = rng.normal(loc=np.arange(16), scale=1 + np.arange(16) / 4, size=(5000, 16))
    return X, ReferenceSummary.fit(X)


# -- EWMA --------------------------------------------------------------------------------
@pytest.mark.parametrize("alpha", [0.01, 0.3, 1.0])
def test_ewma_closed_form_equals_loop(alpha):
    rng = np.random.default_rng(1)
    chunks = [rng.normal(size=k) for k in (1, 7, 250, 3)]
    e = Ewma(alpha)
    for c in chunks:
        e.update(c)
    assert e.value == pytest.approx(sequential_ewma(alpha, np.concatenate(chunks)), rel=1e-12)
    e2 = Ewma(alpha, value=5.0)
    e2.update(chunks[2])
    assert e2.value == pytest.approx(sequential_ewma(alpha, chunks[2], 5.0), rel=1e-12)


def test_ewma_threshold_and_non_finite():
    e = Ewma(0.5, threshold=0.6)
    assert e.update([]) is None and not e.exceeded
    e.update([0.0, np.nan, 1.0, np.inf])
    assert e.value == 0.5 and not e.exceeded
    e.update(1.0)
    assert e.value == 0.75 and e.exceeded
    with pytest.raises(ValueError):
        Ewma(0.0)


# -- reference summary -------------------------------------------------------------------
def test_fit_picks_high_variance_features():
    rng = np.random.default_rng(2)
    X = np.zeros((300, 8, 8), np.float32)
    X[:, 2:6, 2:6] = rng.normal(size=(300, 4, 4))  # the "digit": only the centre varies
    X[:, 0, 0] = rng.normal(size=300) * 0.01  # barely varies
    ref = ReferenceSummary.fit(X, max_features=16)
    centre = sorted(r * 8 + c for r in range(2, 6) for c in range(2, 6))
    assert ref.features.tolist() == centre
    assert ref.sample.shape == (16, 300) and ref.edges.shape == (16, 9) and ref.ref_props.shape == (16, 10)
    assert np.allclose(ref.ref_props.sum(axis=1), 1)
    assert np.all(np.diff(ref.sample, axis=1) >= 0)
    assert ReferenceSummary.fit(X, features=[0, 63]).features.tolist() == [0, 63]
    with pytest.raises(ValueError, match="indices"):
        ReferenceSummary.fit(X, features=[64])
    with pytest.raises(ValueError, match="NaN"):
        ReferenceSummary.fit(np.full((4, 2), np.nan))


def test_sample_is_bounded(reference):
    _, ref = reference
    assert ref.sample.shape == (16, 500) and ref.n_reference == 5000


def test_serialisation_round_trip(reference):
    _, ref = reference
    text = json.dumps(ref.to_dict())
    assert len(text) < 80_000
    back = ReferenceSummary.from_dict(json.loads(text))
    assert back.n_inputs == ref.n_inputs and back.n_reference == ref.n_reference
    for name in ("features", "edges", "ref_props", "sample"):
        assert np.array_equal(getattr(back, name), getattr(ref, name)), name
    bad = json.loads(text)
    bad["edges"] = bad["edges"][:3]
    with pytest.raises(ValueError, match="shape"):
        ReferenceSummary.from_dict(bad)
    with pytest.raises(ValueError, match="invalid reference summary"):
        ReferenceSummary.from_dict({"format_version": 1})


# -- monitor -----------------------------------------------------------------------------
def test_config():
    cfg = from_params(DriftConfig, {"window": "500", "psi_threshold": "0.25"}, section="drift")
    assert (cfg.window, cfg.psi_threshold) == (500, 0.25)
    with pytest.raises(ConfigError, match="drift.min_samples"):
        from_params(DriftConfig, {"window": "50"}, section="drift")


def test_ks_matches_scipy():
    rng = np.random.default_rng(3)
    a = rng.normal(size=(5, 200)).astype(np.float32)
    b = np.round(rng.normal(0.2, 1, size=(5, 300)), 1).astype(np.float32)  # ties
    d, p = ks_2samp_rows(a, b)
    for i in range(5):
        r = stats.ks_2samp(a[i], b[i], method="asymp")
        assert d[i] == pytest.approx(r.statistic, abs=1e-12) and p[i] == pytest.approx(r.pvalue, rel=1e-9)


def test_no_drift_on_reference_distribution(reference):
    X, ref = reference
    rng = np.random.default_rng(4)
    mon = DriftMonitor(ref, window=1000)
    for _ in range(20):  # 1280 rows in batches of 64
        mon.update(rng.normal(loc=np.arange(16), scale=1 + np.arange(16) / 4, size=(64, 16)))
    r = mon.scores()
    assert r.n == 1000 and not r.flagged
    assert r.fraction < 0.2 and r.psi.max() < 0.1
    mon.check()
    assert mon.ewma.value == r.fraction and not mon.ewma.exceeded


def test_shift_of_one_sd_is_flagged(reference):
    X, ref = reference
    rng = np.random.default_rng(5)
    scale = 1 + np.arange(16) / 4
    mon = DriftMonitor(ref, DriftConfig(window=1000))
    for _ in range(10):
        mon.update(rng.normal(loc=np.arange(16) + scale, scale=scale, size=(64, 16)))
    r = mon.scores()
    assert r.flagged and r.fraction == 1.0 and r.n == 640
    assert (r.psi > 0.2).all() and (r.ks_p < 1e-6).all()
    summary = r.to_dict(top=3)
    assert summary["flagged"] and summary["drifted"] == 16 and len(summary["worst"]) == 3
    json.dumps(summary)
    # half the features shifted is still a flag (>= 50 %); a quarter is not
    for shifted, flagged in ((8, True), (4, False)):
        mon = DriftMonitor(ref, window=1000)
        loc = np.arange(16) + np.where(np.arange(16) < shifted, scale, 0)
        mon.update(rng.normal(loc=loc, scale=scale, size=(1000, 16)))
        assert mon.scores().flagged is flagged


def test_no_verdict_before_min_samples(reference):
    _, ref = reference
    mon = DriftMonitor(ref, min_samples=100)
    assert mon.scores().n == 0 and not mon.scores().flagged
    mon.update(np.full((50, 16), 100.0))
    r = mon.scores()
    assert r.fraction == 1.0 and not r.flagged


def test_window_memory_is_bounded(reference):
    _, ref = reference
    mon = DriftMonitor(ref, window=100, min_samples=10)
    buf = mon._buf
    for k in (1, 30, 99, 250, 7):
        mon.update(np.zeros((k, 16)))
        assert mon.count <= 100 and mon.window().shape[0] == mon.count
    assert mon.count == 100 and mon.seen == 387 and mon._buf is buf and buf.nbytes == 100 * 16 * 4
    # the window holds exactly the newest rows
    mon.update(np.arange(130 * 16, dtype=np.float64).reshape(130, 16))
    assert sorted(mon.window()[:, 0].tolist()) == [16.0 * i for i in range(30, 130)]
    mon.update(np.full((3, 16), -1.0))
    assert sorted(mon.window()[:, 0].tolist()) == [-1.0] * 3 + [16.0 * i for i in range(33, 130)]


def test_non_finite_rows_are_skipped_and_width_checked(reference):
    _, ref = reference
    mon = DriftMonitor(ref)
    x = np.zeros((4, 16))
    x[1, 3] = np.nan
    mon.update(x)
    assert mon.count == 3 and mon.skipped == 1
    with pytest.raises(ValueError, match="16"):
        mon.update(np.zeros((2, 15)))


def test_text_features():
    f = text_features([b"hello world 42", "héllo", "", np.str_("a  b\tc")])
    assert f.shape == (4, 4) and f.dtype == np.float32
    assert f[0].tolist() == pytest.approx([14, 2 / 14, 0, 3])
    assert f[1].tolist() == pytest.approx([5, 0, 1 / 5, 1])
    assert f[2].tolist() == [0, 0, 0, 0]
    assert f[3, 3] == 3
    ref = ReferenceSummary.fit(text_features([f"sentence number {i}" for i in range(200)]))
    mon = DriftMonitor(ref, min_samples=50)
    mon.update(text_features(["ДЛИННЫЙ ТЕКСТ " * 20] * 100))
    assert mon.scores().flagged


def test_ks_equals_scipy_axis_form():
    """scipy's own vectorised call (slower: see ks_2samp_rows) on realistic shapes, ties included."""
    rng = np.random.default_rng(11)
    for f, n1, n2 in ((64, 500, 2000), (8, 37, 101), (3, 5000, 900)):
        a = np.sort(rng.normal(size=(f, n1)).astype(np.float32), axis=1)
        b = np.round(rng.normal(0.1, 1.2, size=(f, n2)), 1).astype(np.float32)  # ties
        d0, p0 = ks_2samp_rows(a, b)
        r = stats.ks_2samp(a, b, axis=1, method="asymp")
        np.testing.assert_allclose(r.statistic, d0, rtol=0, atol=1e-9)
        np.testing.assert_allclose(r.pvalue, p0, rtol=0, atol=1e-9)


@pytest.mark.parametrize("n_eff", [3.0, 10.0, 400.0, 1667.0, 4000.0])
@pytest.mark.parametrize("alpha", [0.05 / 64, 0.05 / 4, 1e-6])
def test_ks_below_is_the_exact_p_value_rule(n_eff, alpha):
    """The guard's drift verdict without exact p-values decides every statistic as
    ``p < alpha`` does: over the whole range and densely around the critical value."""
    crit = stats.kstwo.isf(alpha, n_eff)
    d = np.concatenate([np.linspace(0.0, 1.0, 81),
                        crit * (1 + np.linspace(-0.03, 0.03, 61)),
                        crit * (1 + np.linspace(-1e-6, 1e-6, 11))])
    np.testing.assert_array_equal(ks_below(d, n_eff, alpha), ks_p_values(d, n_eff) < alpha)


def test_scoring_a_window_needs_no_exact_p_values(reference, monkeypatch):
    """kstwo.sf runs in Python per value (tens of ms of CPU for 64 features, on the guard
    that serves): a clear verdict is reached without it; the report's p-values are still
    the exact ones when read, and a summary computes only its own features'."""
    X, ref = reference
    rng = np.random.default_rng(12)
    scale = 1 + np.arange(16) / 4
    mon = DriftMonitor(ref, window=1000)
    shifted = np.arange(16) + scale * np.where(np.arange(16) < 8, 1.0, 0.0)  # half the features move
    for _ in range(16):
        mon.update(rng.normal(loc=shifted, scale=scale, size=(64, 16)))
    live = mon.window().copy()
    calls = []
    real_sf = stats.kstwo.sf
    monkeypatch.setattr(stats.kstwo, "sf", lambda d, n: calls.append(np.size(d)) or real_sf(d, n))
    r = mon.scores(live)
    assert sum(calls) <= 2, calls  # only statistics within 2 % of the critical value (none here, or a rare one)
    d, p = ks_2samp_rows(ref.sample, np.ascontiguousarray(live.T))
    alpha = mon.config.alpha / 16
    expected = (p < alpha) | (r.psi > mon.config.psi_threshold)
    np.testing.assert_array_equal(r.drifted, expected)
    assert r.drifted[:8].all() and not r.drifted[8:].any()
    calls.clear()
    summary = r.to_dict(top=3)
    assert calls == [3]  # the 3 summarised features' p-values, in one call
    worst = np.argsort(-r.psi, kind="stable")[:3]
    assert [w["ks_p"] for w in summary["worst"]] == pytest.approx(p[worst].tolist(), rel=1e-12)
    np.testing.assert_allclose(r.ks_p, p, rtol=1e-12, atol=0)
