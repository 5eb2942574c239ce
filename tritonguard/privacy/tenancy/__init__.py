"""Tenancy: whom a request is for, whether that is believed, and how much each tenant may use.

- :mod:`~tritonguard.privacy.tenancy.config`: ``TenancyConfig`` (``tenancy.*``) and ``Quota``;
- :mod:`~tritonguard.privacy.tenancy.auth`: tenant ids from request parameters and forwarded
  headers, and their credentials (``ApiKeys``, ``JwtTokens``, ``TenantResolver``);
- :mod:`~tritonguard.privacy.tenancy.quotas`: admission by token bucket and in-flight cap, per
  process (``QuotaManager``) or shared by a guard's processes on one host (``SharedQuotaManager``);
- :mod:`~tritonguard.privacy.tenancy.fleet`: one quota for every replica through Redis leases
  (``FleetQuotaManager``), the host's quota judging while Redis is unreachable, and one token
  budget per tenant for every replica (``FleetTokenBudget``);
- :mod:`~tritonguard.privacy.tenancy.labels`: ``TenantLabels``, tenants as bounded metric labels;
- :mod:`~tritonguard.privacy.tenancy.budget`: a decoupled guard's token budget (``tokens.*``),
  reserved at admission and settled at the end.

Arrows: ``config`` <- {``auth``, ``quotas``} <- ``fleet`` -> ``budget``; ``labels`` stands alone. May import
:mod:`tritonguard.core` only. Nothing is re-exported here: import a name from the module that
defines it.
"""
