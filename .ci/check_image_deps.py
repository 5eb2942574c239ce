#!/usr/bin/env python3
"""Resolve the Docker image's Python packages for the image's Python, without a container engine.

The Dockerfile builds on ``nvcr.io/nvidia/tritonserver:<TRITON_RELEASE>-py3`` and installs exactly
``docker/requirements-image-<TRITON_RELEASE>.txt``. Each supported release is a profile below
(:data:`PROFILES`): its Python, its glibc (the manylinux tag), its CUDA and the Triton it runs.

- 25.08 (Triton 2.60.0, the Dockerfile's default: it has the fixes for CVE-2025-23319/-23320/-23334):
  Ubuntu 24.04 = glibc 2.39, Python 3.12, CUDA 13.0;
- 24.10 (Triton 2.51.0, the server every test here runs): Ubuntu 22.04 = glibc 2.35, Python 3.10,
  CUDA 12.6.

For each profile this script resolves the file for that CPython on manylinux_2_<glibc> x86-64,
wheels only, against PyPI, and fails when:

- it does not resolve;
- the resolution differs from the file's pins (a package missing from the file, a stale pin, a
  different version): the file must pin every package the image installs;
- a package of another CUDA major is pulled (``nvidia-*-cu12`` in a CUDA 13 image, ``-cu13`` or
  CUDA 13's unsuffixed ``nvidia-*`` / ``cuda-toolkit`` in a CUDA 12 one, ``cuda-python`` of another
  major), torch or onnxruntime-gpu is not a build for the image's CUDA major (judged from their
  wheel metadata: torch's ``Requires-Dist``, onnxruntime-gpu's ``cuda`` extra), or the CUDA runtime
  torch pulls is newer than the image's CUDA;
- the CPU ``onnxruntime`` is pulled beside ``onnxruntime-gpu`` (both install the same module), the
  resolved ``tritonclient`` is not the image's Triton, numpy / protobuf break the release's limits
  (numpy < 2: the image's python backend and tritonclient; protobuf < 5 for tritonclient 2.51),
  ``tomli`` is missing on Python 3.10 (no ``tomllib``), or ``virtualenv`` is left out (the image has
  one that pins filelock < 4, and ``pip check`` in the build would fail).

The resolver is uv (``uv pip compile --python-version X.Y``), bootstrapped from PyPI into
``~/.cache/tritonguard/uv-<version>`` when absent: unlike ``pip install --dry-run
--python-version``, which checks wheel tags for the target but evaluates environment markers for
the running interpreter, uv evaluates markers for the target (``exceptiongroup``, ``async-timeout``
and ``tomli`` are 3.10-only dependencies that pip's dry run leaves out). pip's dry run is used only
to read the two wheels' metadata. Neither reads this machine's pip configuration (local wheel
directories and constraints would skew the answer).

    python .ci/check_image_deps.py                   # every release (exit 0 ok, 1 failed, 3 index unreachable)
    python .ci/check_image_deps.py --release 25.08   # one release
    python .ci/check_image_deps.py --release 25.08 --write   # re-resolve its top-level section, rewrite the pins
"""

# ruff: noqa: T201 - a command-line check: it reports on stdout/stderr
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
INDEX_URL = os.environ.get("IMAGE_INDEX_URL", "https://pypi.org/simple")
UV_VERSION = "0.13.8"
PINNED_MARKER = "# -- pinned:"  # the line that starts the generated section of a requirements file
EXIT_FAILED, EXIT_UNREACHABLE = 1, 3
# CUDA packages whose own version is the CUDA version (13.0.x = CUDA 13.0); other nvidia-* wheels
# number themselves (CUDA 13's cufft is 12.x, its curand 10.x)
CUDA_VERSIONED = ("cuda-toolkit", "cuda-python", "cuda-bindings", "nvidia-cuda-runtime",
                  "nvidia-cuda-nvrtc", "nvidia-cuda-cupti", "nvidia-nvjitlink", "nvidia-cublas")
# CUDA libraries numbered exactly like the toolkit they come from (nvJitLink 13.5 is CUDA 13.5's):
# none may be newer than the image's CUDA (cuBLAS numbers itself: CUDA 13.0 ships cuBLAS 13.1)
CUDA_RELEASED = ("cuda-toolkit", "nvidia-cuda-runtime", "nvidia-cuda-nvrtc", "nvidia-cuda-cupti",
                 "nvidia-nvjitlink", "nvidia-nvtx")


@dataclass(frozen=True)
class Profile:
    """One NGC release the Dockerfile can build on: what its image has, and the list for it."""

    release: str  # NGC release, the Dockerfile's TRITON_RELEASE
    triton: str  # the Triton server version of that release (= tritonclient's version)
    python: str  # /usr/bin/python3 of the image
    glibc: int  # manylinux_2_<glibc>: the image's Ubuntu
    cuda: tuple[int, int]  # CUDA of the image
    limits: tuple[tuple[str, int, str], ...]  # (package, major it must stay under, why)

    @property
    def requirements(self) -> Path:
        return DOCKER / f"requirements-image-{self.release}.txt"

    @property
    def uv_platform(self) -> str:
        return f"x86_64-manylinux_2_{self.glibc}"

    @property
    def pip_platforms(self) -> list[str]:
        return [f"manylinux_2_{m}_x86_64" for m in range(self.glibc, 16, -1)] + [
            "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64"]

    @property
    def runtime_package(self) -> str:
        """The wheel of the CUDA runtime (libcudart) for this CUDA major: CUDA 13 dropped the suffix."""
        return "nvidia-cuda-runtime-cu12" if self.cuda[0] == 12 else "nvidia-cuda-runtime"

    @property
    def needs_tomli(self) -> bool:
        return tuple(int(x) for x in self.python.split(".")) < (3, 11)


_NUMPY = ("numpy", 2, "the image's python backend and tritonserver wheel install numpy<2")
PROFILES: dict[str, Profile] = {
    # Triton 2.60.0: server build.py r25.08 (Ubuntu 24.04 base, Python 3.12); release notes: CUDA
    # 13.0.0. Has the fixes for CVE-2025-23319/-23320/-23334 (25.07 and later).
    "25.08": Profile("25.08", "2.60.0", "3.12", 39, (13, 0),
                     (_NUMPY, ("protobuf", 6, "tritonclient 2.60 needs protobuf>=5.26.1,<6"))),
    # Triton 2.51.0 = the binary nvidia-pytriton 0.7.0 bundles: every test here runs it
    "24.10": Profile("24.10", "2.51.0", "3.10", 35, (12, 6),
                     (_NUMPY, ("protobuf", 5, "tritonclient 2.51 needs protobuf<5"))),
}
DEFAULT_RELEASE = "25.08"  # the Dockerfile's ARG TRITON_RELEASE


class Unreachable(RuntimeError):
    pass


def canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def split_file(path: Path) -> tuple[list[str], dict[str, str]]:
    """(lines of the top-level section, {canonical name: version} of the pinned section)."""
    top: list[str] = []
    pins: dict[str, str] = {}
    in_pins = False
    for line in path.read_text().splitlines():
        if line.startswith(PINNED_MARKER):
            in_pins = True
            continue
        if not in_pins:
            top.append(line)
            continue
        req = line.split("#", 1)[0].strip()
        if req:
            m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", req)
            if not m:
                raise SystemExit(f"{path}: pinned section needs NAME==VERSION lines, got {req!r}")
            pins[canon(m.group(1))] = m.group(2)
    return top, pins


def pinned_header(profile: Profile) -> str:
    """The marker line that opens the pinned section: it names the target it was resolved for."""
    return (f"{PINNED_MARKER} every package the image installs, for Python {profile.python} "
            f"/ {profile.uv_platform} (written by .ci/check_image_deps.py --write) --")


def clean_env() -> dict[str, str]:
    """This environment without pip/uv settings; TLS trust as pip is configured here."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "UV_"))}
    env["PIP_CONFIG_FILE"] = os.devnull  # no pip.conf at all: no find-links, no constraints
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    cert = os.environ.get("PIP_CERT") or os.environ.get("REQUESTS_CA_BUNDLE")
    if not cert and Path("/etc/ssl/certs/ca-certificates.crt").exists():
        cert = "/etc/ssl/certs/ca-certificates.crt"
    if cert and "SSL_CERT_FILE" not in env:
        env["SSL_CERT_FILE"] = cert
    return env


def check_reachable(timeout: float = 15.0) -> None:
    env_cert = clean_env().get("SSL_CERT_FILE")
    import ssl  # noqa: PLC0415

    ctx = ssl.create_default_context(cafile=env_cert) if env_cert else None
    url = INDEX_URL.rstrip("/") + "/pip/"
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=ctx) as resp:
            resp.read(1)
    except (urllib.error.URLError, OSError, TimeoutError) as exc:
        raise Unreachable(f"package index {INDEX_URL} unreachable: {exc}") from None


def find_uv() -> str:
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    target = cache / "tritonguard" / f"uv-{UV_VERSION}"
    uv = target / "bin" / "uv"
    if uv.exists():
        return str(uv)
    # pip with this machine's normal configuration: uv is an ordinary PyPI wheel
    out = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", str(target),
                          f"uv=={UV_VERSION}"], capture_output=True, text=True, check=False)
    if out.returncode != 0 or not uv.exists():
        raise SystemExit(f"cannot install uv=={UV_VERSION}: {out.stderr.strip()[-2000:]}")
    return str(uv)


def uv_compile(req_file: Path, profile: Profile,
               prefer: dict[str, str] | None = None) -> dict[str, tuple[str, list[str]]]:
    """{canonical name: (version, [via ...])} for the profile's target; raises on a failed
    resolution. ``prefer``: versions uv keeps where they still fit (the file's current pins)."""
    with tempfile.TemporaryDirectory() as tmp:
        out_file = Path(tmp) / "resolved.txt"
        if prefer:  # uv prefers the versions already in its output file
            out_file.write_text("".join(f"{n}=={v}\n" for n, v in sorted(prefer.items())))
        cmd = [find_uv(), "pip", "compile", "--quiet", "--no-config", "--no-header",
               "--python-version", profile.python, "--python-platform", profile.uv_platform,
               "--only-binary", ":all:", "--index-url", INDEX_URL,
               "--annotation-style", "line", "-o", str(out_file), str(req_file)]
        res = subprocess.run(cmd, capture_output=True, text=True, env=clean_env(), check=False)
        if res.returncode != 0:
            err = res.stderr.strip()
            if re.search(r"error sending request|Connect|dns error|timed out", err):
                raise Unreachable(err[-1500:])
            raise AssertionError(f"the {profile.release} image's requirements do not resolve for Python "
                                 f"{profile.python} / {profile.uv_platform}:\n{err[-4000:]}")
        resolved: dict[str, tuple[str, list[str]]] = {}
        for line in out_file.read_text().splitlines():
            m = re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)\s*(?:#\s*via\s+(.*))?$", line.strip())
            if m:
                via = [v.strip() for v in (m.group(3) or "").split(",") if v.strip()]
                resolved[canon(m.group(1))] = (m.group(2), via)
        return resolved


def wheel_metadata(name: str, version: str, profile: Profile) -> tuple[str, list[str]]:
    """(wheel file name, Requires-Dist) of the wheel pip picks for the target: metadata only."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--dry-run", "--ignore-installed",
               "--no-deps", "--index-url", INDEX_URL, "--python-version", profile.python,
               "--only-binary=:all:", "--report", str(report), f"{name}=={version}"]
        for p in profile.pip_platforms:
            cmd += ["--platform", p]
        res = subprocess.run(cmd, capture_output=True, text=True, env=clean_env(), check=False)
        if res.returncode != 0:
            raise AssertionError(f"pip cannot find a {profile.python} wheel of {name}=={version}:"
                                 f"\n{res.stderr.strip()[-2000:]}")
        item = json.loads(report.read_text())["install"][0]
        return (item["download_info"]["url"].rsplit("/", 1)[-1],
                item["metadata"].get("requires_dist") or [])


def _dep_name(req: str) -> str:
    return canon(re.split(r"[\s;<>=!~\[(]", req.strip(), maxsplit=1)[0])


def _major(version: str) -> int | None:
    m = re.match(r"(\d+)", version)
    return int(m.group(1)) if m else None


def foreign_cuda(name: str, version: str | None, major: int) -> bool:
    """True when package ``name`` (at ``version``, when known) belongs to another CUDA major than
    ``major``: a ``-cuNN`` suffix of another major, a CUDA-numbered package (:data:`CUDA_VERSIONED`)
    of another major, or, in a CUDA 12 image, CUDA 13's unsuffixed ``nvidia-*`` wheels."""
    m = re.search(r"-cu(\d+)$", name)
    if m:
        return int(m.group(1)) != major
    if name in CUDA_VERSIONED and version is not None:
        return _major(version) != major
    return major < 13 and (name == "cuda-toolkit" or name.startswith("nvidia-"))


def check_cuda_names(resolved: dict[str, tuple[str, list[str]]], profile: Profile) -> list[str]:
    """Offline part of the CUDA check: no package of another CUDA major in the resolution, no CUDA
    library of a newer CUDA than the image's (:data:`CUDA_RELEASED`), no CPU onnxruntime."""
    problems: list[str] = []
    major = profile.cuda[0]
    foreign = sorted(f"{n}=={v}" for n, (v, _) in resolved.items()
                     if (n.startswith(("nvidia-", "cuda-")) or n == "cuda-toolkit")
                     and foreign_cuda(n, v, major))
    if foreign:
        problems.append(f"packages of another CUDA major than the image's CUDA {major} in the "
                        f"resolution: {', '.join(foreign)}")
    for name, (ver, via) in sorted(resolved.items()):
        m = re.match(r"(\d+)\.(\d+)", ver)
        if re.sub(r"-cu\d+$", "", name) in CUDA_RELEASED and m \
                and (int(m.group(1)), int(m.group(2))) > profile.cuda:
            problems.append(f"{name} {ver} (via {', '.join(via) or '?'}) is newer than the image's "
                            f"CUDA {profile.cuda[0]}.{profile.cuda[1]}")
    if "onnxruntime" in resolved:
        problems.append(f"the CPU onnxruntime is pulled (via {', '.join(resolved['onnxruntime'][1])}): "
                        "it and onnxruntime-gpu install the same module")
    return problems


def torch_cuda_problems(version: str, wheel: str, deps: list[str], profile: Profile) -> list[str]:
    """torch's wheel is a build for the image's CUDA major, and the CUDA it pins (its
    ``nvidia-cuda-runtime-cu12==`` or ``cuda-toolkit[…]==``) is not newer than the image's."""
    major = profile.cuda[0]
    problems = []
    nv = sorted({_dep_name(d) for d in deps if "nvidia" in d or "cuda" in d})
    ours = [n for n in nv if not foreign_cuda(n, None, major)
            and (n.endswith(f"-cu{major}") or n in CUDA_VERSIONED)]
    bad = [n for n in nv if foreign_cuda(n, None, major)]
    pins = [d for d in deps if _dep_name(d) in ("cuda-toolkit", profile.runtime_package)]
    for d in pins:  # a CUDA-numbered pin: its major must be the image's
        m = re.search(r"==\s*(\d+)\.(\d+)", d)
        if m and int(m.group(1)) != major:
            bad.append(d.split(";")[0].strip())
        elif m and (int(m.group(1)), int(m.group(2))) > profile.cuda:
            problems.append(f"torch {version} pulls CUDA {m.group(1)}.{m.group(2)} "
                            f"({d.split(';')[0].strip()}), newer than the image's CUDA "
                            f"{profile.cuda[0]}.{profile.cuda[1]}")
    if not ours or bad:
        problems.append(f"torch {version} ({wheel}) is not a CUDA {major} build: its CUDA "
                        f"dependencies are {nv or 'none (a CPU build?)'}")
    return problems


def ort_cuda_problems(version: str, wheel: str, deps: list[str], profile: Profile) -> list[str]:
    """onnxruntime-gpu's ``cuda`` extra names the CUDA runtime of the image's major and nothing of
    another major (CUDA 12 builds: ``nvidia-*-cu12``; CUDA 13 builds: ``nvidia-cuda-runtime~=13.0``)."""
    major = profile.cuda[0]
    extra = [d for d in deps if re.search(r"extra\s*==\s*.cuda.", d)]
    names = sorted({_dep_name(d) for d in extra})
    runtime = [d for d in extra if _dep_name(d) == profile.runtime_package]
    runtime_ok = bool(runtime) and (major == 12 or any(re.search(rf"[=~]=\s*{major}\b", d) for d in runtime))
    if not runtime_ok or any(foreign_cuda(n, None, major) for n in names):
        return [f"onnxruntime-gpu {version} ({wheel}): its 'cuda' extra names "
                f"{names or 'nothing'}, not the CUDA {major} runtime"]
    return []


def check_cuda(resolved: dict[str, tuple[str, list[str]]], profile: Profile) -> list[str]:
    problems = check_cuda_names(resolved, profile)
    notes: list[str] = []
    if "torch" not in resolved:
        problems.append("torch is not in the resolution")
    else:
        tv = resolved["torch"][0]
        wheel, deps = wheel_metadata("torch", tv, profile)
        problems += torch_cuda_problems(tv, wheel, deps, profile)
        rt = resolved.get(profile.runtime_package, ("", []))
        cuda_pin = next((d.split(";")[0].strip() for d in deps
                         if _dep_name(d) in ("cuda-toolkit", profile.runtime_package)), "no CUDA pin")
        notes.append(f"torch {tv}: {wheel}; {cuda_pin}; {profile.runtime_package} {rt[0]} "
                     f"via {', '.join(rt[1]) or '?'}")
    if "onnxruntime-gpu" not in resolved:
        problems.append("onnxruntime-gpu is not in the resolution")
    else:
        ov = resolved["onnxruntime-gpu"][0]
        wheel, deps = wheel_metadata("onnxruntime-gpu", ov, profile)
        problems += ort_cuda_problems(ov, wheel, deps, profile)
        extra = sorted({_dep_name(d) for d in deps if re.search(r"extra\s*==\s*.cuda.", d)})
        notes.append(f"onnxruntime-gpu {ov}: {wheel}; cuda extra: {', '.join(extra)}")
    for line in notes:
        print(f"  {line}")
    return problems


def check_pins(resolved: dict[str, tuple[str, list[str]]], pins: dict[str, str],
               profile: Profile) -> list[str]:
    """The resolution is exactly the pins, and within the release's limits."""
    problems = []
    for name, (ver, via) in sorted(resolved.items()):
        if name not in pins:
            problems.append(f"{name}=={ver} is installed (via {', '.join(via)}) but not pinned")
        elif pins[name] != ver:
            problems.append(f"{name}: pinned {pins[name]}, resolves to {ver}")
    problems += [f"{n}=={v} is pinned but not installed" for n, v in sorted(pins.items())
                 if n not in resolved]
    problems += check_release(resolved, profile)
    return problems


def check_release(resolved: dict[str, tuple[str, list[str]]], profile: Profile) -> list[str]:
    """What the release's image needs of a resolution (offline: versions only)."""
    problems = []
    for name, limit, why in profile.limits:
        ver = resolved.get(name, ("0",))[0]
        if (_major(ver) or 0) >= limit:
            problems.append(f"{name} {ver}: {why} ({name}<{limit})")
    client = resolved.get("tritonclient", ("",))[0]
    if client != profile.triton:
        problems.append(f"tritonclient {client or 'is missing'}: the {profile.release} image runs "
                        f"Triton {profile.triton}, pin tritonclient[all]=={profile.triton}")
    if profile.needs_tomli and "tomli" not in resolved:
        problems.append(f"tomli is missing: Python {profile.python} has no tomllib "
                        "([tool.tritonguard] layer)")
    if "virtualenv" not in resolved:
        problems.append("virtualenv is missing: the image's own virtualenv pins filelock<4, so the "
                        "build's pip check fails unless the list upgrades it")
    return problems


def write(profile: Profile, path: Path) -> None:
    top, pins = split_file(path)
    with tempfile.TemporaryDirectory() as tmp:
        top_file = Path(tmp) / "requirements.in"
        top_file.write_text("\n".join(top) + "\n")
        resolved = uv_compile(top_file, profile, prefer=pins)
    lines = list(top)
    while lines and not lines[-1].strip():
        lines.pop()
    lines += ["", pinned_header(profile)]
    for name, (ver, _via) in sorted(resolved.items()):
        lines.append(f"{name}=={ver}")
    path.write_text("\n".join(lines) + "\n")
    print(f"wrote {len(resolved)} pins to {path}")


def check_one(profile: Profile, path: Path, *, rewrite: bool) -> list[str]:
    if rewrite:
        write(profile, path)
    _, pins = split_file(path)
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    print(f"resolving {shown} (NGC {profile.release}, Triton {profile.triton}) for Python "
          f"{profile.python} / {profile.uv_platform} against {INDEX_URL}")
    resolved = uv_compile(path, profile)
    problems = check_pins(resolved, pins, profile) + check_cuda(resolved, profile)
    if not problems:
        print(f"  ok: {len(resolved)} packages resolve and match the pins; torch and onnxruntime-gpu "
              f"are CUDA {profile.cuda[0]} builds")
    return [f"{profile.release}: {p}" for p in problems]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--release", choices=[*PROFILES, "all"], default="all",
                    help="the NGC release whose list to check (default: every one)")
    ap.add_argument("--requirements", type=Path,
                    help="check this file instead of docker/requirements-image-<release>.txt "
                         "(needs one --release)")
    ap.add_argument("--write", action="store_true", help="rewrite the pinned section")
    args = ap.parse_args(argv)
    releases = list(PROFILES) if args.release == "all" else [args.release]
    if (args.requirements or args.write) and len(releases) != 1:
        ap.error("--requirements and --write need one --release")
    start = time.monotonic()
    problems: list[str] = []
    try:
        check_reachable()
        for release in releases:
            profile = PROFILES[release]
            problems += check_one(profile, args.requirements or profile.requirements, rewrite=args.write)
    except Unreachable as exc:
        print(f"SKIP: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except AssertionError as exc:
        print(f"FAIL: {exc}", file=sys.stderr)
        return EXIT_FAILED
    if problems:
        for p in problems:
            print(f"FAIL: {p}", file=sys.stderr)
        return EXIT_FAILED
    print(f"ok: {', '.join(releases)} ({time.monotonic() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
