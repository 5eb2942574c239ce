"""Console entries `tritonserver` and `perf_analyzer` that exec the real binaries.

`tritonserver` looks for a real Triton in this order: ``$TRITONSERVER_BIN``,
``/opt/tritonserver/bin/tritonserver`` (the NGC image), the binary bundled in the
``nvidia-pytriton`` wheel. For the bundled one it composes a backend directory (the wheel's
python backend, the stub for the running Python, and every Python-based backend found in
``backends/``), puts this interpreter's ``bin`` first on PATH and its LIBDIR first on
LD_LIBRARY_PATH (the stub embeds libpython and would otherwise load the system's copy, which
breaks ``_ssl`` and so transformers), then passes every flag through.
"""

from __future__ import annotations

import csv
import importlib.util
import ipaddress
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from tritonguard.core.files import atomic_path
from tritonguard.core.objectstore import ENV_REPOSITORY, is_object_store
from tritonguard.core.store import ENV_URL, NamespaceError, home, namespace
from tritonguard.ops.supervisor.control import flag_value, supervise, with_default_control

NGC_TRITONSERVER = Path("/opt/tritonserver/bin/tritonserver")
NGC_BACKENDS = Path("/opt/tritonserver/backends")
# Every folder here holding a model.py is a Python-based backend (`backend: "<folder>"`).
PROJECT_BACKENDS = Path(__file__).resolve().parents[2] / "backends"  # tritonguard/ops/ -> the project


# Every Triton API that changes the server rather than reading it: client shared-memory
# registration (step two of the 2025 Python-backend advisories CVE-2025-23319/-23320/-23334,
# fixed in NGC 25.07), model load/unload, model configs, trace and log settings. Triton 2.51 and
# every release up to 2.73 accept exactly these category names (server src/restricted_features.h
# is unchanged between them), so no version check is needed to pass them.
ADMIN_APIS = ("shared-memory", "model-repository", "model-config", "trace", "logging")
ENV_ADMIN_KEY = "TRITONGUARD_ADMIN_KEY"
ENV_ADMIN_HEADER = "TRITONGUARD_ADMIN_HEADER"
DEFAULT_ADMIN_HEADER = "x-tritonguard-admin-key"
# frontend -> (its flag prefix, the flag restricting its APIs)
_FRONTENDS = {"http": ("--http", "--http-restricted-api"), "grpc": ("--grpc", "--grpc-restricted-protocol")}


class LaunchError(RuntimeError):
    """A binary or library that the launcher needs is missing; the message says what to do."""


def _pytriton_root() -> Path | None:
    # found, not imported: importing pytriton pulls numpy and more into the supervisor that
    # stays beside the server for its whole life (optional: absent in the NGC image)
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations))).resolve() / "tritonserver"
    return root if (root / "bin" / "tritonserver").exists() else None


def python_backends(root: Path = PROJECT_BACKENDS) -> dict[str, Path]:
    """Backend name -> folder, for every ``<root>/<name>/model.py``."""
    if not root.is_dir():
        return {}
    return {p.parent.name: p.parent for p in sorted(root.glob("*/model.py"))}


def compose_backend_dir(pytriton_root: Path, dest: Path) -> Path:
    """Build ``dest`` as a Triton backend directory; safe to call repeatedly and concurrently."""
    ver = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = pytriton_root / "python_backend_stubs" / ver / "triton_python_backend_stub"
    if not stub.exists():
        raise LaunchError(
            f"nvidia-pytriton ships no python backend stub for Python {ver} ({stub}); "
            "use Python 3.8-3.13"
        )
    dest.mkdir(parents=True, exist_ok=True)
    py = dest / "python"
    py.mkdir(exist_ok=True)
    # Real files, not symlinks: Triton rejects a backend library whose realpath leaves the
    # backend directory ("escapes backend directory").
    for src in (pytriton_root / "backends" / "python").iterdir():
        if src.is_file():
            _place_file(src, py / src.name)
    _place_file(stub, py / "triton_python_backend_stub")
    wanted = python_backends()
    for name, folder in wanted.items():
        _symlink(folder, dest / name)
    for entry in dest.iterdir():  # drop backends that no longer exist in backends/
        if entry.is_symlink() and entry.name not in wanted and entry.name != "python":
            entry.unlink()
    return dest


def _place_file(src: Path, dest: Path) -> None:
    """Hard-link (or copy) ``src`` to ``dest`` unless an identical file is already there."""
    st = src.stat()
    if dest.exists() and not dest.is_symlink():
        dt = dest.stat()
        if (dt.st_ino == st.st_ino and dt.st_dev == st.st_dev) or (
            dt.st_size == st.st_size and int(dt.st_mtime) == int(st.st_mtime)
        ):
            return
    with atomic_path(dest, fsync=False) as tmp:
        try:
            os.link(src, tmp)
        except OSError:
            shutil.copy2(src, tmp)


def _symlink(target: Path, link: Path) -> None:
    if link.is_symlink() and Path(os.readlink(link)) == target:
        return
    with atomic_path(link, fsync=False) as tmp:  # a concurrent launcher never sees a half-made link
        tmp.symlink_to(target)


def _state_dir() -> Path:
    return home()


def server_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for the server: this interpreter's bin first, its LIBDIR first."""
    env = dict(os.environ if base is None else base)
    bindir = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join([bindir, env.get("PATH", "")]).rstrip(os.pathsep)
    libdirs = [sysconfig.get_config_var("LIBDIR") or ""]
    cudart = _cudart_dir()
    if cudart:
        libdirs.append(str(cudart))
    if env.get("LD_LIBRARY_PATH"):
        libdirs.append(env["LD_LIBRARY_PATH"])
    env["LD_LIBRARY_PATH"] = os.pathsep.join(d for d in libdirs if d)
    # the Python stubs must find the project and its venv packages
    root = str(PROJECT_BACKENDS.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    return env


def _has_flag(args: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def advertise_env(args: Sequence[str], environ: dict[str, str] | None = None) -> dict[str, str]:
    """The ``TRITONGUARD_ADVERTISE_*`` variables the guards register their replica with
    (``tritonguard.rollout.replicas``): Triton's HTTP, gRPC and metrics URLs from ``--http-port``,
    ``--grpc-port`` and ``--metrics-port`` (Triton's defaults 8000/8001/8002) on
    ``$TRITONGUARD_ADVERTISE_HOST`` (default 127.0.0.1; the Helm chart sets the pod's IP, so each
    pod registers its own replica key), and the start time. Variables already
    set in ``environ`` are kept (an operator's override, e.g. a load balancer's name)."""
    from tritonguard.rollout import replicas  # noqa: PLC0415 - constants only; redis is not imported

    env = os.environ if environ is None else environ
    host = env.get(replicas.ENV_HOST) or "127.0.0.1"
    # an IPv6 pod IP (the chart's $(POD_IP) on a v6 or dual-stack cluster) goes in brackets
    netloc = f"[{host}]" if ":" in host and not host.startswith("[") else host
    ports = {"http": flag_value(args, "--http-port") or "8000",
             "grpc": flag_value(args, "--grpc-port") or "8001",
             "metrics": flag_value(args, "--metrics-port") or "8002"}
    wanted = {replicas.ENV_HOST: host,
              replicas.ENV_HTTP: f"http://{netloc}:{ports['http']}",
              replicas.ENV_GRPC: f"{netloc}:{ports['grpc']}",
              replicas.ENV_METRICS: f"http://{netloc}:{ports['metrics']}/metrics",
              replicas.ENV_STARTED: f"{time.time():.3f}"}
    return {k: env[k] if env.get(k) else v for k, v in wanted.items()}


def model_repositories(args: Sequence[str]) -> list[str]:
    """The ``--model-repository`` / ``--model-store`` values, as given (URLs kept whole)."""
    out, it = [], iter(args)
    for a in it:
        for flag in ("--model-repository", "--model-store"):
            if a == flag:
                out.append(next(it, ""))
            elif a.startswith(flag + "="):
                out.append(a.split("=", 1)[1])
    return out


def object_store_env(args: Sequence[str], env: dict[str, str]) -> dict[str, str]:
    """An object-store repository (``s3://…``): the guards are told where it is
    (``$TRITONGUARD_REPOSITORY``, Triton gives them only a temporary copy of their own folder),
    and the rollout state must be in Redis: nothing the guards write may go into the store, and
    the file store would land in the shared ``/tmp``. Raises LaunchError without
    ``$TRITONGUARD_STATE_URL``."""
    remote = [r for r in model_repositories(args) if is_object_store(r)]
    if is_object_store(env.get(ENV_REPOSITORY, "")):
        remote = remote or [env[ENV_REPOSITORY]]
    if not remote:
        return env
    if not env.get(ENV_URL):
        raise LaunchError(f"the model repository {remote[0]} is in an object store: set {ENV_URL}=redis://… "
                          "(rollout state, breakers and latency samples cannot live in the store)")
    if len(remote) > 1 and not env.get(ENV_REPOSITORY):
        raise LaunchError(f"several object-store repositories ({', '.join(remote)}): set {ENV_REPOSITORY} "
                          "to the one the guards route in")
    env.setdefault(ENV_REPOSITORY, remote[0])
    return env


def _flag_values(args: Sequence[str], name: str) -> list[str]:
    """Every value of ``--name=value`` / ``--name value``, in order (Triton accumulates the
    restricted-API groups of repeated flags)."""
    out = []
    for i, a in enumerate(args):
        if a.startswith(name + "="):
            out.append(a.split("=", 1)[1])
        elif a == name and i + 1 < len(args):
            out.append(args[i + 1])
    return out


def restricted_apis(args: Sequence[str], flag: str) -> set[str]:
    """The API categories that ``flag`` (``--http-restricted-api`` or
    ``--grpc-restricted-protocol``, ``<apis>:<header>=<key>``) restricts, over every occurrence."""
    return {api.strip() for spec in _flag_values(args, flag) if ":" in spec
            for api in spec.split(":", 1)[0].split(",") if api.strip()}


def is_loopback(host: str) -> bool:
    """True for a loopback address or ``localhost``; a wildcard, a routable address or any other
    name is beyond loopback."""
    host = host.strip().strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def exposed_frontends(args: Sequence[str]) -> dict[str, str]:
    """Frontend (http, grpc) -> the address it binds to, for each one enabled and listening beyond
    loopback (Triton binds both to 0.0.0.0 unless told otherwise)."""
    out = {}
    for name, (prefix, _) in _FRONTENDS.items():
        if (flag_value(args, f"--allow-{name}") or "true").lower() in ("false", "0", "no", "off"):
            continue
        address = flag_value(args, f"{prefix}-address") or "0.0.0.0"
        if not is_loopback(address):
            out[name] = address
    return out


def restrict_admin_apis(args: Sequence[str], environ: dict[str, str] | None = None) -> list[str]:
    """``args`` with every API in :data:`ADMIN_APIS` restricted on each frontend that listens
    beyond loopback: the categories the given flags leave open are put behind
    ``$TRITONGUARD_ADMIN_HEADER: $TRITONGUARD_ADMIN_KEY`` (header default
    ``x-tritonguard-admin-key``; what exporter and the supervisor send). Without a key the launcher
    refuses (LaunchError) rather than serve load/unload and shared-memory registration to the
    network. A loopback-only server is left as it is. The message never holds the key; Triton
    itself only takes it on its command line, so it is visible to ``ps`` on the host."""
    env = os.environ if environ is None else environ
    exposed = exposed_frontends(args)
    out = list(args)
    if not exposed:
        return out
    key = env.get(ENV_ADMIN_KEY, "")
    header = env.get(ENV_ADMIN_HEADER, "") or DEFAULT_ADMIN_HEADER
    if not header.replace("-", "").isalnum() or not header.isascii():
        raise LaunchError(f"{ENV_ADMIN_HEADER} must be letters, digits and '-' (an HTTP header name)")
    for name, address in exposed.items():
        flag = _FRONTENDS[name][1]
        missing = [api for api in ADMIN_APIS if api not in restricted_apis(out, flag)]
        if not missing:
            continue
        if not key:
            raise LaunchError(
                f"Triton's {name.upper()} frontend would listen on {address} with its admin APIs "
                f"({', '.join(missing)}) open to anyone who reaches it: set {ENV_ADMIN_KEY} (clients then "
                f"send the header {header}), restrict them with {flag}, or bind --{name}-address=127.0.0.1")
        group = f"{flag}={','.join(missing)}:{header}={key}"
        # the supervisor reads the repository API's header from the last --http-restricted-api:
        # last when it holds model-repository, else before the operator's own groups (one of
        # which restricts the repository API then)
        first = next((i for i, a in enumerate(out) if a == flag or a.startswith(flag + "=")), len(out))
        out.insert(len(out) if "model-repository" in missing else first, group)
    return out


def resolve_tritonserver(args: Sequence[str]) -> tuple[str, list[str], dict[str, str]]:
    """Return (binary, argv, env) for the real tritonserver with our backends wired in, and its
    admin APIs restricted when it listens beyond loopback (:func:`restrict_admin_apis`)."""
    binary, argv, env = _resolve_tritonserver(args)
    return binary, [argv[0], *restrict_admin_apis(argv[1:], env)], env


def _resolve_tritonserver(args: Sequence[str]) -> tuple[str, list[str], dict[str, str]]:
    args = list(args)
    env = object_store_env(args, server_env())
    env.update(advertise_env(args, env))  # the guards register this replica with these URLs
    try:  # the guards' Redis keys carry it: a bad one is refused here, not by every guard's load
        namespace(env)
    except NamespaceError as exc:
        raise LaunchError(str(exc)) from None
    explicit = os.environ.get("TRITONSERVER_BIN")
    if explicit:
        if not Path(explicit).exists():
            raise LaunchError(f"TRITONSERVER_BIN={explicit} does not exist")
        return explicit, [explicit, *args], env
    if NGC_TRITONSERVER.exists():
        binary = str(NGC_TRITONSERVER)
        # The Dockerfile links backends/* into /opt/tritonserver/backends; nothing to compose.
        return binary, [binary, *args], env
    root = _pytriton_root()
    if root is None:
        raise LaunchError(
            "no tritonserver found: set TRITONSERVER_BIN, use the NGC image "
            "(nvcr.io/nvidia/tritonserver:24.10-py3), or `pip install nvidia-pytriton==0.7.0`"
        )
    binary = str(root / "bin" / "tritonserver")
    # The backend files are linked elsewhere, so their RPATH ($ORIGIN/../../../../
    # nvidia_pytriton.libs) no longer resolves: give the wheel's bundled libraries explicitly.
    libs = root.parent.parent / "nvidia_pytriton.libs"
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (env["LD_LIBRARY_PATH"], str(libs)) if p)
    if not _has_flag(args, "--backend-directory"):
        bdir = compose_backend_dir(root, _state_dir() / "backends")
        args.insert(0, f"--backend-directory={bdir}")
    if not _has_flag(args, "--cache-directory"):
        args.insert(0, f"--cache-directory={root / 'caches'}")
    return binary, [binary, *args], env


def _cudart_dir() -> Path | None:
    try:
        spec = importlib.util.find_spec("nvidia.cuda_runtime")
    except ImportError:  # no `nvidia` namespace at all
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for base in spec.submodule_search_locations:
        lib = Path(base) / "lib"
        if (lib / "libcudart.so.12").exists():
            return lib
    return None


def _missing_shared_libs(binary: str, env: dict[str, str]) -> list[str]:
    ldd = shutil.which("ldd")
    if ldd is None:
        return []

    out = subprocess.run([ldd, binary], env=env, capture_output=True, text=True, check=False)
    return [line.split()[0] for line in out.stdout.splitlines() if "not found" in line]


def _is_elf(path: Path) -> bool:
    try:
        with open(path, "rb") as fh:
            return fh.read(4) == b"\x7fELF"
    except OSError:
        return False


def resolve_perf_analyzer(args: Sequence[str]) -> tuple[str, list[str], dict[str, str]]:
    # The tritonclient wheel installs the binary twice, as bin/perf_analyzer and bin/perf_client
    # (same SHA-256 in its RECORD). This console script replaces the first, so exec the second.
    bindir = Path(sys.prefix) / "bin"
    candidates = [os.environ.get("PERF_ANALYZER_BIN", ""), str(bindir / "perf_client"),
                  str(bindir / "perf_analyzer"), "/usr/local/bin/perf_analyzer"]
    binary = next((c for c in candidates if c and _is_elf(Path(c))), "")
    if not binary:
        raise LaunchError(
            "perf_analyzer binary not found: `pip install 'tritonclient[all]==2.51.0'` (its x86-64 "
            "manylinux wheel ships it as bin/perf_client), or set PERF_ANALYZER_BIN"
        )
    env = server_env()
    missing = _missing_shared_libs(binary, env)
    if missing:
        hints = {
            "libb64.so.0d": "apt-get install libb64-0d",
            "libcudart.so.12": "pip install nvidia-cuda-runtime-cu12",
        }
        todo = "; ".join(f"{lib}: {hints.get(lib, 'install the package providing it')}" for lib in missing)
        raise LaunchError(f"perf_analyzer cannot start, missing shared libraries -> {todo}")
    return binary, [binary, *args], env


def perf_analyzer_run(url: str, model: str, concurrency: int, data: Path, *, window_ms: int, trials: int,
                      stability_pct: float, timeout: float) -> tuple[dict[str, str] | None, str]:
    """One perf_analyzer measurement over HTTP at one concurrency: (its CSV row, or None when it
    failed, and its output). Callers choose what to retry (``bench`` and ``exporter tune``)."""
    binary, _, env = resolve_perf_analyzer([])
    fd, name = tempfile.mkstemp(suffix=".csv")
    os.close(fd)
    csv_path = Path(name)
    cmd = [binary, "-m", model, "-u", url, "-i", "http", "--input-data", str(data),
           "--concurrency-range", str(concurrency), "-p", str(window_ms), "--max-trials", str(trials),
           "-s", str(stability_pct), "-f", str(csv_path)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False, timeout=timeout)
        with open(csv_path) as fh:
            rows = list(csv.DictReader(fh))
    finally:
        csv_path.unlink(missing_ok=True)
    output = (proc.stdout + proc.stderr).strip()
    return (rows[0] if proc.returncode == 0 and rows else None), output


def _exec(resolver, argv: Sequence[str]) -> int:
    try:
        binary, full, env = resolver(argv)
    except LaunchError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2
    os.execve(binary, full, env)
    return 0  # pragma: no cover - execve does not return


def tritonserver_main() -> int:
    """Serve under the supervisor (``tritonguard.ops.supervisor``): dead stubs are reloaded, a crashed
    server restarted, leftover stubs killed. ``TRITONGUARD_SUPERVISE=0`` execs Triton directly.
    Without ``--model-control-mode`` the server runs in ``explicit`` mode with every model
    loaded at start (what the default ``none`` serves), so the supervisor can reload one model."""
    if os.environ.get("TRITONGUARD_SUPERVISE", "1").lower() in ("0", "false", "no", "off"):
        return _exec(resolve_tritonserver, sys.argv[1:])

    try:
        binary, full, env = resolve_tritonserver(with_default_control(sys.argv[1:]))
    except LaunchError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2
    return supervise(binary, full, env)


def perf_analyzer_main() -> int:
    return _exec(resolve_perf_analyzer, sys.argv[1:])
