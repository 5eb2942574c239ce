"""Routing inside a guard: which version answers each request, and how the versions are judged.

:class:`~.router.Router` routes one batch and falls back down the chain; it is handed its
collaborators: :class:`~.view.RolloutView` (the rollout state in hand), :class:`~.breakers.Breakers`,
:class:`~.goldens.GoldensChecker`, :class:`~.signals.Signals` (breaker feeds, input drift, alerts)
and the :class:`~.comparison.ComparisonWorker` with its comparator. :mod:`.stream` is the same for
one generation at a time. :mod:`.config` holds ``routing.*``.
"""
