#!/usr/bin/env python3
"""Resolve the Docker image's Python packages for the image's Python, without a container engine.

The image (``nvcr.io/nvidia/tritonserver:24.10-py3``: Ubuntu 22.04 = glibc 2.35, Python 3.10,
CUDA 12.6) installs exactly ``docker/requirements-image.txt``. This script resolves that file for
CPython 3.10 on manylinux_2_35 x86-64, wheels only, against PyPI, and fails when:

- it does not resolve;
- the resolution differs from the file's pins (a package missing from the file, a stale pin, a
  different version): the file must pin every package the image installs;
- torch or onnxruntime-gpu is not a CUDA 12 build, judged from their wheel metadata (torch
  ``Requires-Dist`` names ``nvidia-*-cu12`` and no ``-cu13`` / ``cuda-toolkit``; onnxruntime-gpu's
  ``cuda`` extra names ``nvidia-*-cu12``), or the CUDA runtime torch pulls is newer than the image's;
- the CPU ``onnxruntime`` is pulled beside ``onnxruntime-gpu`` (both install the same module), or
  numpy >= 2 / protobuf >= 5 (tritonclient 2.51), or ``tomli`` is missing (Python 3.10 has no
  ``tomllib``).

The resolver is uv (``uv pip compile --python-version 3.10``), bootstrapped from PyPI into
``~/.cache/tritonguard/uv-<version>`` when absent: unlike ``pip install --dry-run
--python-version``, which checks wheel tags for the target but evaluates environment markers for
the running interpreter, uv evaluates markers for 3.10 (``exceptiongroup``, ``async-timeout`` and
``tomli`` are 3.10-only dependencies that pip's dry run leaves out). pip's dry run is used only to
read the two wheels' metadata. Neither reads this machine's pip configuration (local wheel
directories and constraints would skew the answer).

    python .ci/check_image_deps.py            # check (exit 0 ok, 1 failed, 3 index unreachable)
    python .ci/check_image_deps.py --write    # re-resolve the top-level section, rewrite the pins
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
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REQUIREMENTS = ROOT / "docker" / "requirements-image.txt"
INDEX_URL = os.environ.get("IMAGE_INDEX_URL", "https://pypi.org/simple")
PYTHON_VERSION = "3.10"  # the NGC image's /usr/bin/python3
UV_PLATFORM = "x86_64-manylinux_2_35"  # Ubuntu 22.04: glibc 2.35
PIP_PLATFORMS = [f"manylinux_2_{m}_x86_64" for m in range(35, 16, -1)] + [
    "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64"]
IMAGE_CUDA = (12, 6)  # CUDA of nvcr.io/nvidia/tritonserver:24.10-py3
UV_VERSION = "0.13.8"
PINNED_MARKER = "# -- pinned:"  # the line that starts the generated section of REQUIREMENTS
EXIT_FAILED, EXIT_UNREACHABLE = 1, 3


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


def uv_compile(req_file: Path) -> dict[str, tuple[str, list[str]]]:
    """{canonical name: (version, [via ...])} for the target; raises on a failed resolution."""
    with tempfile.TemporaryDirectory() as tmp:
        out_file = Path(tmp) / "resolved.txt"
        cmd = [find_uv(), "pip", "compile", "--quiet", "--no-config", "--no-header",
               "--python-version", PYTHON_VERSION, "--python-platform", UV_PLATFORM,
               "--only-binary", ":all:", "--index-url", INDEX_URL,
               "--annotation-style", "line", "-o", str(out_file), str(req_file)]
        res = subprocess.run(cmd, capture_output=True, text=True, env=clean_env(), check=False)
        if res.returncode != 0:
            err = res.stderr.strip()
            if re.search(r"error sending request|Connect|dns error|timed out", err):
                raise Unreachable(err[-1500:])
            raise AssertionError(f"the image's requirements do not resolve for Python "
                                 f"{PYTHON_VERSION} / {UV_PLATFORM}:\n{err[-4000:]}")
        resolved: dict[str, tuple[str, list[str]]] = {}
        for line in out_file.read_text().splitlines():
            m = re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)\s*(?:#\s*via\s+(.*))?$", line.strip())
            if m:
                via = [v.strip() for v in (m.group(3) or "").split(",") if v.strip()]
                resolved[canon(m.group(1))] = (m.group(2), via)
        return resolved


def wheel_metadata(name: str, version: str) -> tuple[str, list[str]]:
    """(wheel file name, Requires-Dist) of the wheel pip picks for the target: metadata only."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--dry-run", "--ignore-installed",
               "--no-deps", "--index-url", INDEX_URL, "--python-version", PYTHON_VERSION,
               "--only-binary=:all:", "--report", str(report), f"{name}=={version}"]
        for p in PIP_PLATFORMS:
            cmd += ["--platform", p]
        res = subprocess.run(cmd, capture_output=True, text=True, env=clean_env(), check=False)
        if res.returncode != 0:
            raise AssertionError(f"pip cannot find a {PYTHON_VERSION} wheel of {name}=={version}:"
                                 f"\n{res.stderr.strip()[-2000:]}")
        item = json.loads(report.read_text())["install"][0]
        return (item["download_info"]["url"].rsplit("/", 1)[-1],
                item["metadata"].get("requires_dist") or [])


def _dep_name(req: str) -> str:
    return canon(re.split(r"[\s;<>=!~\[(]", req.strip(), maxsplit=1)[0])


def check_cuda(resolved: dict[str, tuple[str, list[str]]]) -> list[str]:
    problems: list[str] = []
    notes: list[str] = []
    cu13 = sorted(n for n in resolved if n.endswith("-cu13") or n == "cuda-toolkit"
                  or (n.startswith("nvidia-") and not n.endswith("-cu12"))
                  or (n in ("cuda-python", "cuda-bindings") and not resolved[n][0].startswith("12.")))
    if cu13:
        problems.append(f"CUDA 13 packages in the resolution: {', '.join(cu13)}")
    if "torch" not in resolved:
        problems.append("torch is not in the resolution")
    else:
        tv = resolved["torch"][0]
        wheel, deps = wheel_metadata("torch", tv)
        nv = sorted({_dep_name(d) for d in deps if "nvidia" in d or "cuda" in d})
        bad = [n for n in nv if n.endswith("-cu13") or n == "cuda-toolkit"
               or (n.startswith("nvidia-") and not n.endswith("-cu12"))]
        if not nv or bad:
            problems.append(f"torch {tv} ({wheel}) is not a CUDA 12 build: its CUDA "
                            f"dependencies are {nv or 'none (a CPU build?)'}")
        rt = next((d for d in deps if _dep_name(d) == "nvidia-cuda-runtime-cu12"), "")
        m = re.search(r"==\s*(\d+)\.(\d+)", rt)
        if m and (int(m.group(1)), int(m.group(2))) > IMAGE_CUDA:
            problems.append(f"torch {tv} pulls CUDA runtime {m.group(1)}.{m.group(2)}, newer than "
                            f"the image's CUDA {IMAGE_CUDA[0]}.{IMAGE_CUDA[1]}")
        via = resolved.get("nvidia-cuda-runtime-cu12", ("", []))
        notes.append(f"torch {tv}: {wheel}; {rt.split(';')[0] or 'no CUDA runtime pin'}; "
                     f"nvidia-cuda-runtime-cu12 {via[0]} via {', '.join(via[1]) or '?'}")
    if "onnxruntime-gpu" not in resolved:
        problems.append("onnxruntime-gpu is not in the resolution")
    else:
        ov = resolved["onnxruntime-gpu"][0]
        wheel, deps = wheel_metadata("onnxruntime-gpu", ov)
        cuda_extra = sorted({_dep_name(d) for d in deps if re.search(r"extra\s*==\s*.cuda.", d)})
        if not cuda_extra or not all(n.endswith("-cu12") for n in cuda_extra):
            problems.append(f"onnxruntime-gpu {ov} ({wheel}): its 'cuda' extra names "
                            f"{cuda_extra or 'nothing'}, not the CUDA 12 runtime")
        notes.append(f"onnxruntime-gpu {ov}: {wheel}; cuda extra: {', '.join(cuda_extra)}")
    if "onnxruntime" in resolved:
        problems.append(f"the CPU onnxruntime is pulled (via {', '.join(resolved['onnxruntime'][1])}): "
                        "it and onnxruntime-gpu install the same module")
    for line in notes:
        print(f"  {line}")
    return problems


def check_pins(resolved: dict[str, tuple[str, list[str]]], pins: dict[str, str]) -> list[str]:
    problems = []
    for name, (ver, via) in sorted(resolved.items()):
        if name not in pins:
            problems.append(f"{name}=={ver} is installed (via {', '.join(via)}) but not pinned")
        elif pins[name] != ver:
            problems.append(f"{name}: pinned {pins[name]}, resolves to {ver}")
    problems += [f"{n}=={v} is pinned but not installed" for n, v in sorted(pins.items())
                 if n not in resolved]
    for name, limit in (("numpy", 2), ("protobuf", 5)):
        ver = resolved.get(name, ("0",))[0]
        if int(ver.split(".")[0]) >= limit:
            problems.append(f"{name} {ver}: tritonclient 2.51 needs {name}<{limit}")
    if "tomli" not in resolved:
        problems.append("tomli is missing: Python 3.10 has no tomllib ([tool.tritonguard] layer)")
    return problems


def write(path: Path) -> None:
    top, _ = split_file(path)
    with tempfile.TemporaryDirectory() as tmp:
        top_file = Path(tmp) / "requirements.in"
        top_file.write_text("\n".join(top) + "\n")
        resolved = uv_compile(top_file)
    lines = list(top)
    while lines and not lines[-1].strip():
        lines.pop()
    lines += ["", f"{PINNED_MARKER} every package the image installs, for Python {PYTHON_VERSION} "
              f"/ {UV_PLATFORM} (written by .ci/check_image_deps.py --write) --"]
    for name, (ver, _via) in sorted(resolved.items()):
        lines.append(f"{name}=={ver}")
    path.write_text("\n".join(lines) + "\n")
    print(f"wrote {len(resolved)} pins to {path}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requirements", type=Path, default=REQUIREMENTS)
    ap.add_argument("--write", action="store_true", help="rewrite the pinned section")
    args = ap.parse_args(argv)
    start = time.monotonic()
    try:
        check_reachable()
        if args.write:
            write(args.requirements)
        _, pins = split_file(args.requirements)
        print(f"resolving {args.requirements.relative_to(ROOT) if args.requirements.is_relative_to(ROOT) else args.requirements} "
              f"for Python {PYTHON_VERSION} / {UV_PLATFORM} against {INDEX_URL}")
        resolved = uv_compile(args.requirements)
        problems = check_pins(resolved, pins) + check_cuda(resolved)
    except Unreachable as exc:
        print(f"SKIP: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except AssertionError as exc:
        print(f"FAIL: {exc}", file=sys.stderr)
        return EXIT_FAILED
    took = time.monotonic() - start
    if problems:
        for p in problems:
            print(f"FAIL: {p}", file=sys.stderr)
        return EXIT_FAILED
    print(f"ok: {len(resolved)} packages resolve and match the pins; torch and onnxruntime-gpu "
          f"are CUDA 12 builds ({took:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
