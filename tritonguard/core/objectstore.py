"""A model repository in an S3-compatible object store (boto3).

Specs accepted wherever a repository is named:

- ``s3://bucket/prefix``: the endpoint comes from ``$AWS_ENDPOINT_URL`` (or AWS itself);
- ``s3://http://host:port/bucket/prefix`` (or ``https://``): Triton's own form, endpoint inside.

Credentials and region are boto3's usual ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` /
``AWS_DEFAULT_REGION``; Triton and its stubs read the same variables.

Why boto3 (not s3fs/fsspec): moto, the S3 stand-in the tests use, already depends on it, so the
project has one AWS stack; it is synchronous, does multipart uploads of large artifacts, and the
caller decides the order of uploads, which :func:`publish_order` needs (a version's files, then
its manifest, then the model's config.pbtxt: Triton and the guards only ever see whole versions).
fsspec's listing cache could also hide a version that was just uploaded.

Nothing here is imported unless a repository spec is an ``s3://`` one; boto3 itself is imported
on first use.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from tritonguard.core.errors import ConfigError
from tritonguard.core.files import atomic_write, file_digest
from tritonguard.core.store import home

log = logging.getLogger(__name__)

SCHEME = "s3://"
ENV_REPOSITORY = "TRITONGUARD_REPOSITORY"
ENV_ENDPOINT = "AWS_ENDPOINT_URL"
MANIFEST = "manifest.json"
CONFIG = "config.pbtxt"


class ObjectStoreError(ConfigError):
    """The store cannot be reached, the bucket is missing, a file fails its checksum: one line."""


def is_object_store(spec: object) -> bool:
    return isinstance(spec, str) and spec.startswith(SCHEME)


@dataclass(frozen=True)
class StoreSpec:
    bucket: str
    prefix: str  # no leading or trailing "/"; "" for the bucket's root
    endpoint: str | None = None  # http(s)://host:port, None for boto3's default

    def key(self, rel: str) -> str:
        rel = rel.strip("/")
        return f"{self.prefix}/{rel}" if self.prefix else rel

    def rel(self, key: str) -> str:
        return key[len(self.prefix) + 1:] if self.prefix else key

    @property
    def url(self) -> str:
        """The spec in Triton's form when an endpoint is known, else ``s3://bucket/prefix``."""
        where = f"{self.bucket}/{self.prefix}".rstrip("/")
        return f"{SCHEME}{self.endpoint}/{where}" if self.endpoint else f"{SCHEME}{where}"

    @property
    def cache_key(self) -> str:
        return hashlib.sha256(self.url.encode()).hexdigest()[:16]


def parse(spec: str, environ: Mapping[str, str] | None = None) -> StoreSpec:
    """``s3://bucket/prefix`` or ``s3://http://host:port/bucket/prefix`` -> :class:`StoreSpec`."""
    env = os.environ if environ is None else environ
    if not is_object_store(spec):
        raise ObjectStoreError(f"not an object-store repository: {spec!r} (want s3://bucket/prefix)")
    rest = spec[len(SCHEME):]
    endpoint = None
    if rest.startswith(("http://", "https://")):
        parts = urlsplit(rest)
        if not parts.netloc:
            raise ObjectStoreError(f"repository {spec!r}: no host in the endpoint")
        endpoint = f"{parts.scheme}://{parts.netloc}"
        rest = parts.path
    elif re.match(r"^[^/]+:\d+/", rest):  # Triton's s3://host:port/bucket/path
        host, rest = rest.split("/", 1)
        endpoint = f"http://{host}"
    rest = rest.strip("/")
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise ObjectStoreError(f"repository {spec!r}: no bucket")
    if endpoint is None:
        endpoint = env.get(ENV_ENDPOINT) or None
    return StoreSpec(bucket=bucket, prefix=prefix.strip("/"), endpoint=endpoint and endpoint.rstrip("/"))


def client(spec: StoreSpec) -> Any:
    import boto3  # noqa: PLC0415 - only when a repository is in an object store

    for name in ("boto3", "botocore"):  # "Found credentials in environment variables." on every command
        logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLogger(name).level))

    return boto3.client("s3", endpoint_url=spec.endpoint)


def _one_line(exc: BaseException, spec: StoreSpec) -> ObjectStoreError:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return ObjectStoreError(f"object store {spec.url}: {type(exc).__name__}: {text}")


@dataclass(frozen=True)
class Entry:
    size: int
    etag: str


def list_tree(spec: StoreSpec, sub: str = "", s3: Any = None) -> dict[str, Entry]:
    """Every object under the prefix (and ``sub``), as ``rel -> Entry``."""
    s3 = s3 or client(spec)
    base = spec.key(sub) if sub else spec.prefix
    prefix = f"{base}/" if base else ""
    out: dict[str, Entry] = {}
    try:
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=spec.bucket, Prefix=prefix):
            for obj in page.get("Contents", []) or []:
                if obj["Key"].endswith("/"):
                    continue  # a "folder" marker some tools write
                out[spec.rel(obj["Key"])] = Entry(int(obj["Size"]), str(obj.get("ETag", "")).strip('"'))
    except Exception as exc:  # noqa: BLE001 - botocore's errors: one line for the user
        raise _one_line(exc, spec) from None
    return out


def download(spec: StoreSpec, rel: str, dest: Path, s3: Any = None, *, threads: bool = True) -> Path:
    """``rel`` into ``dest`` (through a temporary name beside it). ``threads=False``: one
    connection on the calling thread (a guard's background fetch: no pool of download threads
    competing with the serving thread for the GIL)."""
    s3 = s3 or client(spec)
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.part")
    try:
        if threads:
            s3.download_file(spec.bucket, spec.key(rel), str(tmp))
        else:
            from boto3.s3.transfer import TransferConfig  # noqa: PLC0415 - only with a store

            s3.download_file(spec.bucket, spec.key(rel), str(tmp), Config=TransferConfig(use_threads=False))
        os.replace(tmp, dest)
    except Exception as exc:  # noqa: BLE001
        tmp.unlink(missing_ok=True)
        raise _one_line(exc, spec) from None
    return dest


CHILD_MIN_BYTES = 4 << 20  # a guard downloads files this large in a child process


def python_for_children() -> str:
    """A Python interpreter that can run this package: this one, unless we are embedded (a
    Triton stub's ``sys.executable`` is the stub, not a Python); then ``python3`` on PATH (the
    launcher puts its own interpreter's ``bin`` first; the NGC image has the one it installs into)."""
    exe = Path(sys.executable or "")
    if exe.name.startswith("python") and exe.is_file():
        return str(exe)
    return shutil.which("python3") or shutil.which("python") or "python3"


# The niceness a child download adds to its own (Linux: 0 to 19 above the guard's): on a
# machine with few cores its reads and writes (boto3's pool, 64 KB at a time) take only the CPU
# the guard's execute() threads leave.
DOWNLOAD_NICE = 10


def download_in_child(spec: StoreSpec, rel: str, dest: Path, timeout: float | None = None) -> Path:
    """:func:`download` in a child Python process, with boto3's pool of connections. A guard's
    fetch of a large artifact runs there: in the guard's own process the download's Python code
    (boto3 reads, 64 KB at a time, and writes) competes with ``execute()`` for the GIL, and each
    switch costs the serving thread up to the interpreter's switch interval (5 ms); measured on a
    256 MB fetch, serving p99 went from 7 to 20 ms in process (issue 39 item 2). The spec (no
    secret: credentials stay in the environment the child inherits) goes on stdin, the child's
    one-line error comes back on stderr; the child exits when its parent does. The child runs at a
    lower CPU priority (:data:`DOWNLOAD_NICE`): a version that is not serving yet waits for the
    CPU, requests that are serving do not."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    job = {"bucket": spec.bucket, "prefix": spec.prefix, "endpoint": spec.endpoint, "rel": rel, "dest": str(dest)}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    try:
        done = subprocess.run([python_for_children(), "-m", "tritonguard.core.objectstore"], input=json.dumps(job),
                              capture_output=True, text=True, env=env, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ObjectStoreError(f"object store {spec.url}: download of {rel} in a child process: "
                               f"{type(exc).__name__}") from None
    if done.returncode != 0:
        lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
        raise ObjectStoreError(lines[-1] if lines and lines[-1].startswith("object store ")
                               else f"object store {spec.url}: download of {rel}: the child exited {done.returncode}")
    return dest


def _child_main() -> int:
    """``python -m tritonguard.core.objectstore``: one download described on stdin (see
    :func:`download_in_child`)."""
    job = json.loads(sys.stdin.read())
    try:
        os.nice(DOWNLOAD_NICE)
    except OSError:  # a platform without priorities: the download still runs
        pass
    parent = os.getppid()

    def orphaned() -> None:  # the guard that asked is gone: stop writing into its cache
        while True:
            if os.getppid() != parent:
                os._exit(3)
            threading.Event().wait(1.0)

    threading.Thread(target=orphaned, daemon=True).start()
    spec = StoreSpec(bucket=job["bucket"], prefix=job["prefix"], endpoint=job["endpoint"])
    try:
        download(spec, job["rel"], Path(job["dest"]), threads=True)
    except ObjectStoreError as exc:
        sys.stderr.write(f"{exc}\n")
        return 1
    return 0


def upload(spec: StoreSpec, src: Path, rel: str, s3: Any = None) -> None:
    s3 = s3 or client(spec)
    try:
        s3.upload_file(str(src), spec.bucket, spec.key(rel))
    except Exception as exc:  # noqa: BLE001
        raise _one_line(exc, spec) from None


def delete(spec: StoreSpec, rels: Iterable[str], s3: Any = None) -> None:
    s3 = s3 or client(spec)
    for rel in rels:
        try:
            s3.delete_object(Bucket=spec.bucket, Key=spec.key(rel))
        except Exception as exc:  # noqa: BLE001
            raise _one_line(exc, spec) from None


def download_tree(spec: StoreSpec, dest: Path, s3: Any = None) -> dict[str, Entry]:
    """The whole prefix into ``dest`` (a fresh working copy); returns what was listed."""
    s3 = s3 or client(spec)
    listed = list_tree(spec, s3=s3)
    for rel in listed:
        download(spec, rel, Path(dest) / rel, s3=s3)
    return listed


# -- publish order ------------------------------------------------------------------------------
def _version_of(rel: str) -> tuple[str, str] | None:
    parts = rel.split("/")
    if len(parts) >= 3 and parts[1].isdigit():
        return parts[0], parts[1]
    return None


def _is_front_config(path: Path) -> bool:
    """A guard's or an ensemble's config: published after the models it calls."""
    try:
        text = path.read_text()
    except OSError:
        return False
    return bool(re.search(r'^\s*backend:\s*"guard"', text, re.M) or re.search(r'^\s*platform:\s*"ensemble"', text, re.M))


def publish_order(rels: Iterable[str], root: Path) -> list[str]:
    """The order in which changed files go up: every other file of a version first, then the
    versions' manifests (and the models' own files beside their configs), then model configs
    (targets before guards and ensembles), then anything else at the top. Triton reads a model
    from its config.pbtxt, and readers count a version only once its manifest is there, so
    nobody sees half a version."""
    def rank(rel: str) -> tuple[int, str]:
        name = rel.rsplit("/", 1)[-1]
        if _version_of(rel) is not None:
            return (1 if name == MANIFEST and rel.count("/") == 2 else 0, rel)
        if name == CONFIG and rel.count("/") == 1:
            return (3 if _is_front_config(Path(root) / rel) else 2, rel)
        if rel.count("/") == 1:  # a model's own file (version_policy.json): read when its config is
            return (1, rel)
        return (4, rel)

    return sorted(rels, key=rank)


def delete_order(rels: Iterable[str]) -> list[str]:
    """Removals in the reverse sense: configs and manifests first, so a version stops counting
    before its files go."""
    def rank(rel: str) -> tuple[int, str]:
        name = rel.rsplit("/", 1)[-1]
        return (0 if name == CONFIG else 1 if name == MANIFEST else 2, rel)

    return sorted(rels, key=rank)


# -- the guard's local view of an object-store repository ---------------------------------------
class RepositoryCache:
    """Models of an object-store repository mirrored under ``cache_dir`` (by default
    ``$TRITONGUARD_HOME/cache/objstore/<hash of the spec>``), one model at a time, only the
    versions that have a manifest in the store (a version without one is being uploaded, or
    being deleted: logged and skipped).

    A version appears in the cache whole and checked, or not at all: its files are downloaded
    under temporary names (``.staging/``), the artifact named in its manifest is checked against
    the manifest's sha256, then the files are renamed into the version's folder, the manifest
    last. A reader counts a version only once its manifest is there
    (:func:`tritonguard.core.repository.complete_versions`), so it never sees a manifest without
    its artifact, nor an artifact that fails its checksum. Every instance of a guard shares the
    cache folder: temporary names are private to a process, and every rename is atomic.

    A file whose ETag has not changed is not fetched again (and not hashed again: it was checked
    when it came). A version the store no longer has (its manifest deleted) is dropped from the
    cache, unless the caller still routes to it (``keep``)."""

    STAGING = ".staging"

    def __init__(self, spec: StoreSpec | str, cache_dir: Path | None = None, environ: Mapping[str, str] | None = None,
                 child_min_bytes: int | None = None):
        self.spec = parse(spec, environ) if isinstance(spec, str) else spec
        # files at least this large are downloaded by a child process (a guard: its serving
        # thread keeps the GIL); None: all on the calling thread, one connection
        self.child_min_bytes = child_min_bytes
        self.root = Path(cache_dir) if cache_dir else home(environ) / "cache" / "objstore" / self.spec.cache_key
        self._s3: Any = None
        self._lock = threading.Lock()  # one sync at a time in this process (the guard's fetcher, initialize())
        self._warned: set[str] = set()  # incomplete versions already logged

    @property
    def s3(self) -> Any:
        if self._s3 is None:
            self._s3 = client(self.spec)
        return self._s3

    def _index_path(self, model: str) -> Path:
        return self.root / f".{model}.index.json"

    def sync(self, model: str, keep: Iterable[int] = ()) -> Path:
        """Bring ``model``'s config and complete versions into the cache, drop the versions the
        store no longer has (except ``keep``); returns its folder. A version that fails (a
        download, its checksum) is left as it was, the others are synced, then the first
        failure is raised."""
        listed = list_tree(self.spec, model, s3=self.s3)
        with self._lock:
            return self._sync(model, listed, {int(v) for v in keep})

    def _sync(self, model: str, listed: dict[str, Entry], keep: set[int]) -> Path:
        index_path = self._index_path(model)
        try:
            index = json.loads(index_path.read_text())
        except (OSError, ValueError):
            index = {}
        by_version: dict[str, list[str]] = {}
        top: list[str] = []
        for rel in listed:
            v = _version_of(rel)
            if v is None:
                top.append(rel)
            elif v[0] == model:
                by_version.setdefault(v[1], []).append(rel)
        complete: dict[str, list[str]] = {}
        for version, rels in sorted(by_version.items(), key=lambda kv: int(kv[0])):
            if f"{model}/{version}/{MANIFEST}" in rels:
                complete[version] = rels
            elif f"{model}/{version}" not in self._warned:
                self._warned.add(f"{model}/{version}")
                log.warning("object store %s: %s version %s has no %s (incomplete upload?): ignored",
                            self.spec.url, model, version, MANIFEST)
        failures: list[ObjectStoreError] = []
        self.root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f"{model}.", dir=self._staging_root()))
        try:
            for version, rels in complete.items():  # the versions first, then the configs (publish order)
                try:
                    self._sync_version(model, version, rels, listed, index, staging)
                except ObjectStoreError as exc:
                    failures.append(exc)
            try:
                self._install(top, listed, index, staging, check=None)
            except ObjectStoreError as exc:
                failures.append(exc)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        if f"{model}/{CONFIG}" in listed:  # an empty listing (a wrong prefix?) drops nothing
            self._drop_gone(model, set(complete), keep)
        atomic_write(index_path, json.dumps({k: v for k, v in index.items() if k in listed}))
        if failures:
            raise failures[0]
        return self.root / model

    def _staging_root(self) -> Path:
        d = self.root / self.STAGING
        d.mkdir(parents=True, exist_ok=True)
        return d

    def _fresh(self, rel: str, listed: dict[str, Entry], index: dict[str, str]) -> bool:
        return index.get(rel) == listed[rel].etag and (self.root / rel).is_file()

    def _sync_version(self, model: str, version: str, rels: list[str], listed: dict[str, Entry],
                      index: dict[str, str], staging: Path) -> None:
        if all(self._fresh(rel, listed, index) for rel in rels):
            return
        manifest_rel = f"{model}/{version}/{MANIFEST}"
        if not self._fresh(manifest_rel, listed, index):
            # a changed version stops counting while its files change, and counts again only
            # once they all are in place and checked (the manifest goes back last)
            (self.root / manifest_rel).unlink(missing_ok=True)
        self._install(rels, listed, index, staging, check=manifest_rel)
        log.info("object store %s: %s v%s fetched and checked", self.spec.url, model, version)

    def _install(self, rels: list[str], listed: dict[str, Entry], index: dict[str, str], staging: Path,
                 check: str | None) -> None:
        """Download the stale ``rels`` under ``staging``; when ``check`` (a version's manifest)
        is given, check the artifact it names; then rename them into place, ``check`` last."""
        staged: dict[str, Path] = {}
        for rel in rels:
            if not self._fresh(rel, listed, index):
                tmp = staging / rel
                if self.child_min_bytes is not None and listed[rel].size >= self.child_min_bytes:
                    download_in_child(self.spec, rel, tmp)
                else:
                    download(self.spec, rel, tmp, s3=self.s3, threads=False)
                staged[rel] = tmp
        if check is not None:
            self._verify(check, staged)
        for rel in sorted(staged, key=lambda r: r == check):
            dest = self.root / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(staged[rel], dest)
            index[rel] = listed[rel].etag

    def _verify(self, manifest_rel: str, staged: dict[str, Path]) -> None:
        """The artifact the manifest names matches its sha256 (the staged copy when it was just
        downloaded; one already in the cache was checked when it came)."""
        model, version = manifest_rel.split("/")[:2]
        path = staged.get(manifest_rel, self.root / manifest_rel)
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ObjectStoreError(f"{model} v{version}: unreadable manifest: {type(exc).__name__}") from None
        artifact, sha = doc.get("artifact"), doc.get("sha256")
        if not artifact or not sha or "/" in str(artifact):
            return  # a folder (tokenizer) or another model's file: nothing to check here
        rel = f"{model}/{version}/{artifact}"
        if rel not in staged:
            if (self.root / rel).is_file():
                return
            raise ObjectStoreError(f"{model} v{version}: {artifact}, named in its manifest, is not in the store: "
                                   "the version is not cached")
        if file_digest(staged[rel]) != sha:
            raise ObjectStoreError(f"{model} v{version}: {artifact} does not match the sha256 in its manifest "
                                   "(not cached)")

    def _drop_gone(self, model: str, in_store: set[str], keep: set[int]) -> None:
        model_dir = self.root / model
        if not model_dir.is_dir():
            return
        for d in sorted(model_dir.iterdir()):
            if not (d.is_dir() and d.name.isdigit()) or d.name in in_store:
                continue
            if int(d.name) in keep:
                log.warning("object store %s: %s v%s is gone from the store but still routed to: kept in the cache",
                            self.spec.url, model, d.name)
                continue
            (d / MANIFEST).unlink(missing_ok=True)  # it stops counting before its files go
            shutil.rmtree(d, ignore_errors=True)
            log.info("object store %s: %s v%s is gone from the store: dropped from the cache",
                     self.spec.url, model, d.name)


__all__ = ["ENV_REPOSITORY", "ObjectStoreError", "RepositoryCache", "StoreSpec", "delete", "delete_order",
           "download", "download_in_child", "download_tree", "home", "is_object_store", "list_tree", "parse", "publish_order",
           "upload"]


if __name__ == "__main__":
    sys.exit(_child_main())
