"""Tenants as metric labels: :class:`TenantLabels` bounds how many distinct values a metric gets."""

from __future__ import annotations

MAX_TENANT_LABELS = 256  # distinct tenant label values on metrics; later tenants share "_other"
OTHER_TENANTS = "_other"


class TenantLabels:
    """A tenant as a metric label, with bounded cardinality: the first ``limit`` tenants seen
    keep their name, later ones share ``_other``. One per guard process, shared by its stages."""

    def __init__(self, limit: int = MAX_TENANT_LABELS):
        self.limit = limit
        self._labels: set[str] = set()

    def __call__(self, tenant: str) -> str:
        if tenant in self._labels:
            return tenant
        if len(self._labels) < self.limit:
            self._labels.add(tenant)
            return tenant
        return OTHER_TENANTS
