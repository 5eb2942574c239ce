"""The Docker image's pinned packages, one list per NGC release, fit that release's Python and CUDA.

Two kinds of test:

- offline, fast: each release's list (docker/requirements-image-<release>.txt) read against its
  profile in .ci/check_image_deps.py (Python, manylinux target, CUDA major, the Triton it runs), and
  the check's CUDA rules fed wheel metadata copied from the real torch / onnxruntime-gpu wheels;
- online, in tests/deploy/test_image.py (with the image checks, `make functional`: it needs PyPI and
  takes 20-40 s a release, which a unit tier of "no server, minutes" should not): the same check as
  `make check-image` resolves each list against PyPI.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / ".ci" / "check_image_deps.py"


def _load():
    spec = importlib.util.spec_from_file_location("check_image_deps", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


deps = _load()
RELEASES = sorted(deps.PROFILES)

# Requires-Dist of real wheels (pip install --dry-run --report, Python 3.12 / 3.10 x86-64), the CUDA
# lines only: what the online check reads from PyPI, here without the network
TORCH_2_13_0 = [  # PyPI's default build: CUDA 13.0
    'cuda-toolkit[cublas,cudart,cufft,cufile,cupti,curand,cusolver,cusparse,nvjitlink,nvrtc,nvtx]==13.0.3; platform_system == "Linux"',
    'cuda-bindings<14,>=13.0.3; platform_system == "Linux" and python_version < "3.15"',
    'nvidia-cudnn-cu13==9.20.0.48; platform_system == "Linux"',
    'nvidia-cusparselt-cu13==0.8.1; platform_system == "Linux"',
    'nvidia-nccl-cu13==2.29.7; platform_system == "Linux"',
    'nvidia-nvshmem-cu13==3.4.5; platform_system == "Linux"',
]
TORCH_2_7_1 = [  # PyPI's default build: CUDA 12.6
    'nvidia-cuda-nvrtc-cu12==12.6.77; platform_system == "Linux" and platform_machine == "x86_64"',
    'nvidia-cuda-runtime-cu12==12.6.77; platform_system == "Linux" and platform_machine == "x86_64"',
    'nvidia-cublas-cu12==12.6.4.1; platform_system == "Linux" and platform_machine == "x86_64"',
    'nvidia-cudnn-cu12==9.5.1.17; platform_system == "Linux" and platform_machine == "x86_64"',
    'nvidia-nccl-cu12==2.26.2; platform_system == "Linux" and platform_machine == "x86_64"',
]
ORT_1_31_1 = ['nvidia-cuda-nvrtc~=13.0; extra == "cuda"', 'nvidia-cuda-runtime~=13.0; extra == "cuda"',
              'nvidia-cufft~=12.0; extra == "cuda"', 'nvidia-curand~=10.0; extra == "cuda"',
              'nvidia-cudnn-cu13~=9.0; extra == "cudnn"']
ORT_1_23_2 = ['nvidia-cuda-nvrtc-cu12~=12.0; extra == "cuda"', 'nvidia-cuda-runtime-cu12~=12.0; extra == "cuda"',
              'nvidia-cufft-cu12~=11.0; extra == "cuda"', 'nvidia-curand-cu12~=10.0; extra == "cuda"',
              'nvidia-cudnn-cu12~=9.0; extra == "cudnn"']


def _pins(release: str) -> dict[str, tuple[str, list[str]]]:
    """A release's pinned section as check_image_deps sees a resolution: {name: (version, via)}."""
    _, pins = deps.split_file(deps.PROFILES[release].requirements)
    return {name: (version, []) for name, version in pins.items()}


def test_the_default_release_has_the_2025_python_backend_fixes():
    # CVE-2025-23319/-23320/-23334 are fixed from NGC 25.07 (Triton 2.59.1); 24.10 stays as an option
    assert deps.DEFAULT_RELEASE in deps.PROFILES
    year, month = (int(x) for x in deps.DEFAULT_RELEASE.split("."))
    assert (year, month) >= (25, 7)
    assert "24.10" in deps.PROFILES and deps.PROFILES["24.10"].triton == "2.51.0"


@pytest.mark.parametrize("release", RELEASES)
def test_each_list_was_resolved_for_its_release(release):
    profile = deps.PROFILES[release]
    text = profile.requirements.read_text()
    # --write names the target in the marker line: a list resolved for another Python says so
    assert deps.pinned_header(profile) in text.splitlines()
    pins = _pins(release)
    assert deps.check_release(pins, profile) == []
    assert deps.check_cuda_names(pins, profile) == []
    assert pins["tritonclient"][0] == profile.triton
    assert {"torch", "onnxruntime-gpu", "virtualenv", "setuptools", "wheel"} <= set(pins)
    assert ("tomli" in pins) == profile.needs_tomli


def test_profiles_tell_cuda_12_and_13_lists_apart():
    new, old = deps.PROFILES["25.08"], deps.PROFILES["24.10"]
    # 24.10's list in the 25.08 image: CUDA 12 wheels, tritonclient 2.51, protobuf is fine there
    crossed = deps.check_cuda_names(_pins("24.10"), new) + deps.check_release(_pins("24.10"), new)
    assert any("another CUDA major" in p and "nvidia-cuda-runtime-cu12" in p for p in crossed), crossed
    assert any("tritonclient 2.51.0" in p for p in crossed), crossed
    # and 25.08's in the 24.10 image: CUDA 13 wheels, no tomli for Python 3.10, protobuf 5
    crossed = deps.check_cuda_names(_pins("25.08"), old) + deps.check_release(_pins("25.08"), old)
    assert any("another CUDA major" in p and "cuda-toolkit" in p and "nvidia-cudnn-cu13" in p
               for p in crossed), crossed
    assert any(p.startswith("tomli is missing") for p in crossed), crossed
    assert any(p.startswith("protobuf 5.") for p in crossed), crossed


def test_a_cuda_library_newer_than_the_image_is_refused():
    profile = deps.PROFILES["25.08"]
    pins = _pins("25.08")
    # cuda-toolkit 13.0.3 accepts any nvJitLink 13.x: unconstrained it resolved to 13.5
    pins["nvidia-nvjitlink"] = ("13.5.37", ["cuda-toolkit"])
    assert any("nvidia-nvjitlink 13.5.37" in p and "newer than the image's CUDA 13.0" in p
               for p in deps.check_cuda_names(pins, profile))
    pins = _pins("24.10")
    pins["nvidia-cuda-runtime-cu12"] = ("12.8.90", ["torch"])
    assert deps.check_cuda_names(pins, deps.PROFILES["24.10"])
    # cuBLAS numbers itself (CUDA 13.0 ships cuBLAS 13.1): not judged by its minor
    assert _pins("25.08")["nvidia-cublas"][0].startswith("13.1.")


def test_torch_and_onnxruntime_builds_are_judged_per_release():
    new, old = deps.PROFILES["25.08"], deps.PROFILES["24.10"]
    assert deps.torch_cuda_problems("2.13.0", "w", TORCH_2_13_0, new) == []
    assert deps.torch_cuda_problems("2.7.1", "w", TORCH_2_7_1, old) == []
    assert deps.torch_cuda_problems("2.13.0", "w", TORCH_2_13_0, old)
    assert deps.torch_cuda_problems("2.7.1", "w", TORCH_2_7_1, new)
    assert deps.torch_cuda_problems("2.0", "w", [], new)  # a CPU build names no CUDA at all
    newer = [d.replace("==13.0.3", "==13.2.1") for d in TORCH_2_13_0]
    assert any("newer than the image's CUDA 13.0" in p for p in deps.torch_cuda_problems("x", "w", newer, new))
    assert deps.ort_cuda_problems("1.31.1", "w", ORT_1_31_1, new) == []
    assert deps.ort_cuda_problems("1.23.2", "w", ORT_1_23_2, old) == []
    assert deps.ort_cuda_problems("1.31.1", "w", ORT_1_31_1, old)
    assert deps.ort_cuda_problems("1.23.2", "w", ORT_1_23_2, new)


def test_pins_and_resolution_must_agree():
    profile = deps.PROFILES["25.08"]
    resolved = _pins("25.08")
    _, pins = deps.split_file(profile.requirements)
    assert deps.check_pins(resolved, pins, profile) == []
    resolved["six"] = ("9.9", ["x"])
    del resolved["virtualenv"]
    problems = deps.check_pins(resolved, pins, profile)
    assert any("six: pinned" in p for p in problems), problems
    assert any(p.startswith("virtualenv==") and "pinned but not installed" in p for p in problems)
    assert any(p.startswith("virtualenv is missing") for p in problems)
