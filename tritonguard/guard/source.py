"""Where a guard finds the repository it routes in (its target's config, manifests, goldens).

- ``$TRITONGUARD_REPOSITORY=s3://…``: Triton hands every model a private temporary copy of its
  own folder (``/tmp/folderXXXXXX``), so the rest of the repository is not on disk. The guard
  mirrors the models it needs into a local cache (:class:`tritonguard.core.objectstore.
  RepositoryCache`: versions with a manifest only, artifacts checked against its sha256) and works
  on that. The rollout state must then be in Redis (``$TRITONGUARD_STATE_URL``).
- ``$TRITONGUARD_REPOSITORY=/path``: that folder.
- neither: the folder Triton loaded the model from, when it is a repository folder (named after
  the model). A temporary copy is refused: its parent is the shared ``/tmp``, where anyone could
  plant ``/tmp/<target>/<v>/model.onnx`` for an in-process guard to load.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

from tritonguard.core import objectstore, repository
from tritonguard.core.errors import ConfigError, TargetError
from tritonguard.core.store import ENV_URL

log = logging.getLogger(__name__)


class RepositorySource:
    def __init__(self, root: Path, cache: objectstore.RepositoryCache | None = None):
        self.root, self.cache = Path(root), cache

    @property
    def remote(self) -> bool:
        return self.cache is not None

    def fetch(self, model: str) -> None:
        """Bring ``model`` into the local view (a no-op for a local repository); a store that
        fails is logged, and what the cache holds stays in use."""
        if self.cache is None:
            return
        try:
            self.cache.sync(model)
        except objectstore.ObjectStoreError as exc:
            if not (self.root / model / repository.CONFIG).exists():
                raise
            log.warning("%s; serving from the cached copy", exc)


def resolve(name: str, model_dir: Path, environ: Mapping[str, str]) -> RepositorySource:
    spec = environ.get(objectstore.ENV_REPOSITORY, "")
    if objectstore.is_object_store(spec):
        if not environ.get(ENV_URL):
            raise ConfigError(f"model '{name}': the repository is in an object store ({objectstore.ENV_REPOSITORY}); "
                              f"set {ENV_URL}=redis://… for the rollout state")
        cache = objectstore.RepositoryCache(spec, environ=environ)
        return RepositorySource(cache.root, cache)
    if spec:
        return RepositorySource(Path(spec))
    model_dir = Path(model_dir)
    if model_dir.name != name:
        raise ConfigError(f"model '{name}' was loaded from a temporary copy, not a repository folder "
                          f"(an object-store repository?): set {objectstore.ENV_REPOSITORY} to the repository")
    return RepositorySource(model_dir.parent)


def check_complete(repo: Path, target: str, version: int) -> None:
    """Refuse a version of a target in this repository that has no manifest."""
    model_dir = Path(repo) / target
    if version > 0 and (model_dir / repository.CONFIG).exists() \
            and version not in repository.complete_versions(model_dir):
        raise TargetError(f"version {version} of '{target}' has no manifest: not served")


__all__ = ["RepositorySource", "check_complete", "resolve"]
