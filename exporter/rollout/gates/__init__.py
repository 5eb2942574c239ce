"""Statistical gates between rollout steps, judged on the guards' Prometheus metrics.

Inputs are two readings of every guard replica's ``/metrics`` (:func:`scrape`, summed by
:meth:`GuardReadings.from_scrapes`); the gates look at what happened *between* them. Each gate
says PASS, FAIL or INCONCLUSIVE, and missing data or too small a sample is INCONCLUSIVE (the
controller holds), never PASS: a canary judged on no traffic must not go through.

The gates are looked at again and again while a step dwells, so each one stays valid under
repeated looks:

- **error rate**: requests that failed, plus requests of fused calls that failed and were
  rescued one by one (``tritonguard_fused_failures_total``): Wald's sequential probability ratio test on the candidate's failed requests,
  H0: p <= p0 (``ok_error_rate``) against H1: p >= p1 (``max_error_rate``). The boundaries are
  FAIL at LLR >= ln(1/alpha) and PASS at LLR <= ln(beta). By Ville's inequality the likelihood
  ratio is a supermartingale under H0 (and its inverse under H1), so these error bounds hold for
  any number and schedule of looks, not only for a look after every request.
- **validator agreement** (``judge="equivalence"``: a re-export or compiled variant of the same
  weights): the same SPRT on the share of compared rows the validator failed (H1: disagreement
  >= 1 - ``min_agreement``, H0: half of that). No FAIL before ``min_compared`` rows.
- **disagreement** (``judge="task"``: a new model, e.g. a retrain): the share of compared rows
  whose answer differs from the primary's (top-1 for a classifier, a cosine under the operator's
  floor for embeddings) against a limit the candidate did not set: ``max_disagreement`` (the
  operator's, :mod:`tritonguard.rollout.judging`), widened only when labelled offline evidence showed
  the candidate no worse (then its offline disagreement's upper bound plus ``max_regression``;
  ``disagreement_limit``, set by ``promote``). FAIL when the Wilson lower bound is above the
  limit at the look's spent alpha (looks counted by doublings of the sample,
  :func:`information_look`), PASS when the upper bound at ``beta`` is below it, otherwise
  INCONCLUSIVE (the controller holds; an undecided last step never promotes). With
  ``min_labels`` the labels decide instead, and this gate only reports (SKIPPED).
- **labels** (task judge): labelled rows of each version since the rollout began, sent with the
  request (parameter ``label``) or joined later (``exporter feedback``, :mod:`tritonguard.rollout.feedback`);
  a non-inferiority test of the candidate's accuracy against the primary's with the margin
  ``max_regression``: FAIL when the upper confidence bound of the difference is below
  ``-max_regression``, and FAIL when one true class or named slice lost more than
  ``max_slice_regression`` of its recall (Bonferroni over the slices judged, each with at least
  ``min_slice_labels`` rows a side). Without ``min_labels`` this gate can stop a candidate but
  never holds one (SKIPPED when it cannot decide); with ``min_labels`` N it holds each step until
  both versions have N labelled rows, then PASSes only when the lower bound shows the candidate
  within the margin (non-inferiority shown), and holds while it cannot tell.
- **breaker**: the candidate's breaker must be closed and must not have tripped in the window.
- **cost** (only with ``max_cost_increase``): the candidate's cost per answered request over the
  primary's, from the guards' cost meter (``tritonguard_cost_total`` by part over
  ``tritonguard_cost_requests_total``; compute seconds where no prices are set), FAIL when the
  ratio exceeds 1 + ``max_cost_increase``. Each version's own part is its target calls; the guard's
  part is the same code whichever version answers, so both sides get the window's pooled guard
  cost per request (charged per batch, it follows the batch's mix: canary copies of candidate
  requests made an identical candidate's guard part read 5-10 % higher). A point estimate on at
  least ``min_requests`` requests a side, no confidence bound: the counters hold sums, not the
  spread of per-request costs.
  Judged only at steps giving the candidate at least ``cost_min_share`` (50 %) and below 100 %:
  a version with a smaller share gets smaller sub-batches, whose fixed per-call cost weighs more
  per request, and at 100 % the primary serves nothing to compare with.
- **latency**: Mann-Whitney U (rank test; latency is heavy-tailed) of the candidate against the
  primary, on samples rebuilt from histogram bucket deltas (bucket midpoints; the open last
  bucket counts as twice its lower edge), computed on the bucket counts directly
  (:func:`mann_whitney`, equal to ``scipy.stats.mannwhitneyu`` on the rebuilt samples). It fails only when the data show the shift
  beyond ``latency_tolerance * |primary median|``: the candidate's latencies less that allowance
  are still slower than the primary's at p < alpha_k (a shift within the allowance, however
  significant, is not a failure). alpha_k is spent with
  a convergent Bonferroni series, alpha_k = alpha * 6 / (pi^2 k^2) at look k: the sum over all
  looks is alpha, so there is no planned number of looks to exceed. PASS when the same test
  shows the candidate's latencies less the allowed shift faster than the primary's at ``beta``
  (the upper bound of the shift is within the allowance; counts spread evenly within their
  buckets, :func:`bucket_samples`); in between it is INCONCLUSIVE. (Exact
  per-call samples, where the guards keep them: :mod:`exporter.rollout.gates.latency`, the same rules on
  ratios.) A Welch t-test and both p99s are reported, never judged on.

Samples restart at each step (the controller re-baselines), so over a rollout of S steps the
family-wise error is at most S times each gate's alpha.
"""
