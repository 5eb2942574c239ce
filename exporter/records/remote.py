"""A repository in an object store, as the exporter's commands see it: a local working copy.

:func:`working_copy` syncs the store's prefix into ``$TRITONGUARD_HOME/work/<hash>/repo`` (files
whose ETag is unchanged are not fetched again, files gone from the store are removed), hands the
command that folder, and when the command succeeded publishes what it changed, in a safe order
(:func:`tritonguard.core.objectstore.publish_order`): every file of a new version, then its
manifest, then the model's config.pbtxt, guards and ensembles last. A version folder without
any file gets its placeholder manifest first (an empty "folder" does not exist in S3, and Triton
then refuses the model: "at least one version must be available").

What a guard or the exporter writes at run time (rollout state, locks, latency samples, hidden
files and partial folders) is never published: with an object-store repository the rollout
state lives in Redis (``$TRITONGUARD_STATE_URL``), which :func:`working_copy` requires when
``needs_state``.

A failed command drops the repository copy (``repo`` and its ETag index), never the rest of the
work folder: the registry beside it (``repo.registry/``, the sqlite MLflow store of this machine
and its mirror of the history) stays. The stage history itself lives in the store, beside the
repository (:class:`exporter.records.history.StoreHistory`); ``origin.json`` in the work folder
says which store a working copy is of (:func:`origin_of`).

Two writers: a publish lists the store again and refuses (nothing published) when one of the
objects it is about to write or delete changed since the copy was made (:func:`conflicts`); with a
Redis state store the check and the uploads hold a lease per store (:func:`publish_lock`), renewed
while the publish runs and confirmed before every upload, so a publish whose lease lapsed stops
before its configs go up. Two commands on one machine share the working copy: run one writing
command per store per machine.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from exporter.errors import ExporterError
from tritonguard.core import objectstore, repository
from tritonguard.core.files import file_digest
from tritonguard.core.store import ENV_URL, NamespaceError, redis_client, redis_prefix, store_error
from tritonguard.rollout.replicas import is_redis, redacted

log = logging.getLogger(__name__)

RUNTIME_NAMES = ("rollout_state.json",)
ORIGIN_FILE = "origin.json"  # in the work folder: the store the copy beside it was made from
# boto3's upload_file: one PUT below 8 MiB (ETag = MD5), else parts of 8 MiB (s3transfer's defaults)
MULTIPART_THRESHOLD = MULTIPART_CHUNK = 8 * 1024 * 1024
MAX_PARTS = 10_000


class RemoteRepositoryError(ExporterError):
    pass


def is_runtime(rel: str) -> bool:
    """A file that a guard or a command writes at run time, never part of the repository."""
    parts = rel.split("/")
    if any(p.startswith(".") for p in parts):
        return True
    name = parts[-1]
    return name.startswith(RUNTIME_NAMES) or name.endswith((".lock", ".tmp", ".part"))


def _digest(path: Path) -> str:
    return file_digest(path, "md5")  # an S3 ETag of a single-part upload


def snapshot(root: Path) -> dict[str, str]:
    """``rel -> md5`` of every repository file under ``root`` (runtime files left out)."""
    out = {}
    root = Path(root)
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            path = Path(dirpath) / name
            rel = path.relative_to(root).as_posix()
            if not is_runtime(rel) and path.is_file():
                out[rel] = _digest(path)
    return out


def fill_empty_versions(root: Path) -> list[Path]:
    """A placeholder manifest in every numeric version folder holding no file."""
    filled = []
    for model_dir in sorted(p for p in Path(root).iterdir() if p.is_dir() and not p.name.startswith(".")):
        for v in repository.versions(model_dir):
            vdir = model_dir / str(v)
            if not any(f.is_file() for f in vdir.rglob("*")):
                repository.write_placeholder(vdir, model_dir.name)
                filled.append(vdir)
    return filled


POLICY_FILE = "version_policy.json"  # beside config.pbtxt: the policy a pinned config was written with


def pin_complete_versions(root: Path) -> list[str]:
    """Name each exported model's versions in its config (``version_policy { specific … }``):
    those its own policy chooses among the complete ones, with a manifest. The own policy is
    kept in ``<model>/version_policy.json`` (Triton and the guards ignore the file; the guards
    refuse unknown config parameters). In an object store Triton sees a version as soon as one
    of its files is there, and "latest" would load one caught mid-upload; the config goes up
    after the manifests (:func:`tritonguard.core.objectstore.publish_order`), so a replica that
    starts while a version is being uploaded loads the versions of the last config, never the
    new one. A model without any manifest (placed by hand) keeps its policy. Returns the models
    whose config changed."""
    pinned = []
    for model_dir in sorted(p for p in Path(root).iterdir() if (p / repository.CONFIG).is_file()):
        every = repository.versions(model_dir)
        complete = [v for v in every if (model_dir / str(v) / repository.MANIFEST).is_file()]
        if not complete:
            continue
        cfg = repository.read_config(model_dir)
        kept = model_dir / POLICY_FILE
        policy = (json.loads(kept.read_text()) if kept.is_file()
                  else cfg.get("version_policy") or {"latest": {"num_versions": 1}})
        if "latest" in policy:
            chosen = complete[-int(policy["latest"].get("num_versions", 1)):]
        elif "specific" in policy:
            named = {str(x) for x in policy["specific"].get("versions", [])}
            chosen = [v for v in complete if str(v) in named]
        else:  # all
            chosen = complete
        if not chosen:
            continue  # none of the versions it names is complete: as it is
        if not kept.is_file():
            kept.write_text(json.dumps(policy, sort_keys=True) + "\n")
        want = {"specific": {"versions": [str(v) for v in chosen]}}
        if cfg.get("version_policy") == want:
            continue
        cfg["version_policy"] = want
        repository.write_config(model_dir, cfg)
        pinned.append(model_dir.name)
    return pinned


def expected_etag(path: Path) -> str:
    """The ETag S3 gives ``path`` once boto3's ``upload_file`` put it: its MD5 for a single
    PUT, else the MD5 of the parts' MD5s and ``-<parts>`` (the part size s3transfer picks)."""
    size = path.stat().st_size
    if size < MULTIPART_THRESHOLD:
        return _digest(path)
    chunk = MULTIPART_CHUNK
    while -(-size // chunk) > MAX_PARTS:
        chunk *= 2
    parts = []
    with open(path, "rb") as f:
        while block := f.read(chunk):
            parts.append(hashlib.md5(block, usedforsecurity=False).digest())
    return f"{hashlib.md5(b''.join(parts), usedforsecurity=False).hexdigest()}-{len(parts)}"


def record_published(work: Path, uploaded: list[str], deleted: list[str]) -> None:
    """Put what this command just published into the copy's ETag index, so the next command
    does not download it again. The ETag is computed from the local file: if another writer
    replaced the object since, the store's ETag differs and the next copy fetches theirs."""
    root, index_path = work / "repo", work / "index.json"
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError):
        index = {}
    for rel in uploaded:
        with contextlib.suppress(OSError):
            index[rel] = expected_etag(root / rel)
    for rel in deleted:
        index.pop(rel, None)
    index_path.write_text(json.dumps(index))


def sync_down(spec: objectstore.StoreSpec, work: Path, s3=None) -> dict[str, str]:
    """Make ``work/repo`` the store's prefix; returns its snapshot."""
    s3 = s3 or objectstore.client(spec)
    root = work / "repo"
    index_path = work / "index.json"
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError):
        index = {}
    listed = objectstore.list_tree(spec, s3=s3)
    root.mkdir(parents=True, exist_ok=True)
    # what the store no longer holds goes from the copy too (runtime files stay: they are local)
    for rel in set(snapshot(root)) - set(listed):
        (root / rel).unlink(missing_ok=True)
    for rel, entry in listed.items():
        if is_runtime(rel):
            continue
        if index.get(rel) == entry.etag and (root / rel).exists():
            continue
        objectstore.download(spec, rel, root / rel, s3=s3)
        index[rel] = entry.etag
    _prune_empty(root)
    index_path.write_text(json.dumps({k: v for k, v in index.items() if k in listed}))
    return snapshot(root)


def _prune_empty(root: Path) -> None:
    for dirpath, _dirs, _files in sorted(os.walk(root), key=lambda t: -len(t[0])):
        if Path(dirpath) != root and not any(Path(dirpath).iterdir()):
            Path(dirpath).rmdir()  # the store holds no empty folder: neither does its copy


def conflicts(seen: Mapping[str, objectstore.Entry], now: Mapping[str, objectstore.Entry],
              touched: list[str]) -> list[str]:
    """The objects this command is about to write or delete that someone else wrote or deleted
    in the store since it was read (``seen``): another exporter's export of the same version
    number, or an edit of the same config."""
    return sorted(rel for rel in touched if seen.get(rel) != now.get(rel))


def publish(spec: objectstore.StoreSpec, root: Path, before: Mapping[str, str], s3=None,
            on_put=None, seen: Mapping[str, objectstore.Entry] | None = None,
            before_put=None) -> tuple[list[str], list[str]]:
    """Upload what changed since ``before`` in the safe order, then delete what went; returns
    (uploaded, deleted) in the order done. With ``seen`` (the store's listing when the working
    copy was made), nothing is published when another writer changed one of those objects
    meanwhile (:class:`RemoteRepositoryError` naming them). ``before_put(rel)`` runs before each
    upload and before the deletions (``rel`` None): raising there stops the publish (the
    publish lock's ownership check: configs go up last, so a lease lost midway never lets a
    config through)."""
    s3 = s3 or objectstore.client(spec)
    fill_empty_versions(root)
    pin_complete_versions(root)
    after = snapshot(root)
    changed = [rel for rel, digest in after.items() if before.get(rel) != digest]
    gone = [rel for rel in before if rel not in after]
    if seen is not None and (changed or gone):
        clash = conflicts(seen, objectstore.list_tree(spec, s3=s3), changed + gone)
        if clash:
            more = f" and {len(clash) - 3} more" if len(clash) > 3 else ""
            raise RemoteRepositoryError(
                f"{spec.url} changed while this command ran: {', '.join(clash[:3])}{more} written or removed by "
                "another writer; nothing published. Run the command again (it starts from the store as it is now)")
    uploaded = []
    for rel in objectstore.publish_order(changed, root):
        if before_put is not None:
            before_put(rel)
        objectstore.upload(spec, root / rel, rel, s3=s3)
        uploaded.append(rel)
        if on_put is not None:
            on_put(rel)
    deleted = objectstore.delete_order(gone)
    if deleted and before_put is not None:
        before_put(None)
    objectstore.delete(spec, deleted, s3=s3)
    return uploaded, deleted


def work_dir(spec: objectstore.StoreSpec, environ: Mapping[str, str] | None = None) -> Path:
    return objectstore.home(environ) / "work" / spec.cache_key


def drop_copy(work: Path) -> None:
    """Forget the repository copy (the next command copies the store afresh), and only it: the
    registry beside it (``repo.registry/``) is not a copy of anything and stays."""
    shutil.rmtree(work / "repo", ignore_errors=True)
    (work / "index.json").unlink(missing_ok=True)


def _write_origin(work: Path, store: objectstore.StoreSpec) -> None:
    doc = {"bucket": store.bucket, "prefix": store.prefix, "endpoint": store.endpoint}
    path = work / ORIGIN_FILE
    with contextlib.suppress(OSError, ValueError):
        if json.loads(path.read_text()) == doc:
            return
    work.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, sort_keys=True) + "\n")


def origin_of(repository: str | os.PathLike) -> objectstore.StoreSpec | None:
    """The store ``repository`` is the working copy of (:func:`working_copy`), None for a folder
    repository of its own."""
    repo = Path(repository)
    if repo.name != "repo":
        return None
    try:
        doc = json.loads((repo.parent / ORIGIN_FILE).read_text())
        return objectstore.StoreSpec(bucket=doc["bucket"], prefix=doc["prefix"], endpoint=doc.get("endpoint"))
    except (OSError, ValueError, KeyError, TypeError):
        return None


@contextmanager
def working_copy(spec: str, *, needs_state: bool = False, environ: Mapping[str, str] | None = None,
                 report=None, read_only: bool = False) -> Iterator[Path]:
    """The local folder a command works on; ``spec`` a local path (yielded as is) or ``s3://…``.
    Publishes what changed only when the block ends without an exception; ``read_only`` (status):
    never, and a copy the command changed anyway is dropped, so it cannot go up later."""
    env = os.environ if environ is None else environ
    if not objectstore.is_object_store(spec):
        yield Path(spec)
        return
    try:
        store = objectstore.parse(spec, env)
    except objectstore.ObjectStoreError as exc:
        raise RemoteRepositoryError(str(exc)) from None
    if needs_state and not env.get(ENV_URL):
        raise RemoteRepositoryError(f"repository {spec} is in an object store: set {ENV_URL}=redis://… "
                                    "(the rollout state cannot live in the store)")
    work = work_dir(store, env)
    _write_origin(work, store)
    try:
        s3 = objectstore.client(store)
        seen = objectstore.list_tree(store, s3=s3)  # before the copy: a change after it is a conflict
        before = sync_down(store, work, s3=s3)
    except objectstore.ObjectStoreError as exc:
        raise RemoteRepositoryError(str(exc)) from None
    root = work / "repo"
    try:
        yield root
    except BaseException:
        # a failed command publishes nothing, and leaves nothing for the next one to publish
        drop_copy(work)
        raise
    if read_only:
        if snapshot(root) != before:
            log.debug("a read-only command changed the working copy of %s: dropped", store.url)
            drop_copy(work)
        return
    try:
        with publish_lock(store, env) as lease:
            uploaded, deleted = publish(store, root, before, s3=s3, seen=seen, before_put=lease.confirm)
    except objectstore.ObjectStoreError as exc:
        drop_copy(work)
        raise RemoteRepositoryError(f"publishing to the store failed: {exc}") from None
    except BaseException:
        drop_copy(work)  # the next command copies the store afresh
        raise
    record_published(work, uploaded, deleted)
    if report is not None and (uploaded or deleted):
        report(f"published to {store.url}: {len(uploaded)} file(s) up, {len(deleted)} removed")
    if not uploaded and not deleted:
        log.debug("nothing changed in %s", store.url)


PUBLISH_LOCK_S = 120.0  # a publisher that stopped renewing (died, stalled) holds the lock this long at most
PUBLISH_RENEW_S = PUBLISH_LOCK_S / 6  # how often a live publish renews it
PUBLISH_WAIT_S = 30.0  # how long a publish waits for another one to finish
_RELEASE = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
# renew only while the token is still ours: 1 renewed, 0 lost (lapsed, or another publisher took it)
_RENEW = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end return 0"


class PublishLease:
    """The publish lock while it is held: renewed by a daemon thread every ``renew_s``, and
    :meth:`confirm`-ed (renewed and checked, one Lua step) before every upload; the token is
    the fencing token. Without Redis, a lease that never fails (:data:`NO_LEASE`)."""

    def __init__(self, client, key: str, token: str, lease_s: float, renew_s: float, where: str, store_url: str):
        self.client, self.key, self.token = client, key, token
        self.lease_ms = max(1, int(lease_s * 1000))
        self.renew_s, self.where, self.store_url = renew_s, where, store_url
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._keep, name=f"publish lease {self.key}", daemon=True)
        self._thread.start()

    def _renew(self) -> bool:
        return bool(self.client.eval(_RENEW, 1, self.key, self.token, self.lease_ms))

    def _keep(self) -> None:
        import redis  # noqa: PLC0415 - imported by publish_lock already

        while not self._stop.wait(self.renew_s):
            try:
                if not self._renew():
                    self.lost.set()
                    log.error("publish lock %s lapsed while publishing to %s (another publisher may hold it)",
                              self.key, self.store_url)
                    return
            except redis.RedisError as exc:  # keep trying: the lease holds until it lapses
                log.warning("publish lock %s: renewal failed: %s", self.key, type(exc).__name__)

    def confirm(self, rel: str | None = None) -> None:
        """Raise :class:`RemoteRepositoryError` unless the lock is still ours (renewing it): what
        comes next (``rel``, or the deletions) is not published."""
        import redis  # noqa: PLC0415

        what = rel or "the removals"
        try:
            ours = not self.lost.is_set() and self._renew()
        except redis.RedisError as exc:
            raise RemoteRepositoryError(
                f"cannot confirm the publish lock of {self.store_url} in {self.where} before {what}: "
                f"{type(exc).__name__}; publishing stopped there, nothing more uploaded. Run the command again"
            ) from None
        if not ours:
            self.lost.set()
            raise RemoteRepositoryError(
                f"the publish lock of {self.store_url} lapsed while publishing (lock {self.key} in {self.where}; "
                f"another exporter may be publishing): stopped before {what}, nothing more uploaded, no config "
                "overwritten. Run the command again (it starts from the store as it is now)")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


class _NoLease:
    def confirm(self, rel: str | None = None) -> None:
        return None


NO_LEASE = _NoLease()


@contextmanager
def publish_lock(store: objectstore.StoreSpec, environ: Mapping[str, str], *, lease_s: float | None = None,
                 renew_s: float | None = None, wait_s: float | None = None) -> Iterator[PublishLease | _NoLease]:
    """With ``$TRITONGUARD_STATE_URL=redis://…``, one publisher per store prefix at a time (the
    check for conflicts and the uploads are then one step): a lease on
    ``<redis_prefix("publish")><store>``, renewed while held (:class:`PublishLease`); without
    Redis, nothing (the check alone leaves a window of one listing). Periods default to
    :data:`PUBLISH_LOCK_S`, :data:`PUBLISH_RENEW_S` and :data:`PUBLISH_WAIT_S`."""
    url = environ.get(ENV_URL, "")
    if not is_redis(url):
        yield NO_LEASE
        return
    import redis  # noqa: PLC0415 - only with a Redis store

    lease_s = PUBLISH_LOCK_S if lease_s is None else lease_s
    renew_s = PUBLISH_RENEW_S if renew_s is None else renew_s
    wait_s = PUBLISH_WAIT_S if wait_s is None else wait_s
    try:
        key = f"{redis_prefix('publish', environ)}{store.cache_key}"
    except NamespaceError as exc:
        raise RemoteRepositoryError(str(exc)) from None
    where = redacted(url)
    client = redis_client(url, timeout=5, retries=True)  # refuses a Redis Cluster node, as every store does
    token = uuid.uuid4().hex
    deadline = time.monotonic() + wait_s
    try:
        while not client.set(key, token, nx=True, px=max(1, int(lease_s * 1000))):
            if time.monotonic() > deadline:
                raise RemoteRepositoryError(f"another exporter has been publishing to {store.url} for over "
                                            f"{wait_s:g} s (lock {key} in {where}); nothing published")
            time.sleep(0.2)
    except redis.RedisError as exc:
        client.close()
        raise RemoteRepositoryError(f"cannot take the publish lock in {where}: {store_error(exc, url)}") from None
    lease = PublishLease(client, key, token, lease_s, renew_s, where, store.url)
    lease.start()
    try:
        yield lease
    finally:
        lease.stop()
        with contextlib.suppress(redis.RedisError):
            client.eval(_RELEASE, 1, key, token)
        client.close()


def remove_work(spec: str, environ: Mapping[str, str] | None = None) -> None:
    """Forget this machine's copy of ``spec`` (never its registry: :func:`drop_copy`)."""
    drop_copy(work_dir(objectstore.parse(spec, environ), environ))


__all__ = ["PublishLease", "RemoteRepositoryError", "drop_copy", "fill_empty_versions", "is_runtime", "origin_of",
           "publish", "publish_lock", "snapshot", "sync_down", "working_copy"]
