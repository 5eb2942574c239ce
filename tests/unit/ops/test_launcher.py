import os
from pathlib import Path

import pytest

from tritonguard.ops import launcher


def test_python_backends_found():
    found = launcher.python_backends()
    assert {"guard", "runtime", "tokenizer"} <= set(found)
    assert all((p / "model.py").exists() for p in found.values())


def test_compose_backend_dir(tmp_path):
    root = launcher._pytriton_root()
    assert root is not None, "nvidia-pytriton is a dependency of the project"
    dest = launcher.compose_backend_dir(root, tmp_path / "backends")
    py = dest / "python"
    # real files (Triton rejects backend libraries whose realpath leaves the directory)
    for name in ("libtriton_python.so", "triton_python_backend_stub", "triton_python_backend_utils.py"):
        assert (py / name).is_file() and not (py / name).is_symlink(), name
    assert os.access(py / "triton_python_backend_stub", os.X_OK)
    assert (dest / "guard" / "model.py").exists()
    # idempotent, and stale backend links are removed
    (dest / "gone").symlink_to(tmp_path)
    launcher.compose_backend_dir(root, dest)
    assert not (dest / "gone").exists()


def test_resolve_bundled_tritonserver(monkeypatch, tmp_path):
    monkeypatch.delenv("TRITONSERVER_BIN", raising=False)
    monkeypatch.setenv("TRITONGUARD_HOME", str(tmp_path))
    monkeypatch.setattr(launcher, "NGC_TRITONSERVER", tmp_path / "absent")
    binary, argv, env = launcher.resolve_tritonserver(["--model-repository=x", "--http-port=1"])
    assert binary.endswith("tritonserver/bin/tritonserver")
    assert f"--backend-directory={tmp_path / 'backends'}" in argv
    assert argv[-2:] == ["--model-repository=x", "--http-port=1"]
    assert env["PATH"].split(os.pathsep)[0] == str(Path(__import__("sys").executable).parent)
    assert "nvidia_pytriton.libs" in env["LD_LIBRARY_PATH"]
    # a user-given backend directory is respected
    _, argv, _ = launcher.resolve_tritonserver(["--backend-directory=/b"])
    assert sum(a.startswith("--backend-directory") for a in argv) == 1


def test_missing_explicit_binary_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TRITONSERVER_BIN", "/nonexistent/tritonserver")
    with pytest.raises(launcher.LaunchError, match="TRITONSERVER_BIN=/nonexistent/tritonserver does not exist"):
        launcher.resolve_tritonserver([])
    assert launcher._exec(launcher.resolve_tritonserver, []) == 2


def test_no_tritonserver_anywhere(monkeypatch, tmp_path):
    monkeypatch.delenv("TRITONSERVER_BIN", raising=False)
    monkeypatch.setattr(launcher, "NGC_TRITONSERVER", tmp_path / "absent")
    monkeypatch.setattr(launcher, "_pytriton_root", lambda: None)
    with pytest.raises(launcher.LaunchError, match="pip install nvidia-pytriton"):
        launcher.resolve_tritonserver([])


def test_perf_analyzer_resolves_binary_and_libraries(monkeypatch):
    monkeypatch.delenv("PERF_ANALYZER_BIN", raising=False)
    binary, argv, env = launcher.resolve_perf_analyzer(["--help"])
    assert launcher._is_elf(Path(binary))
    assert argv[1:] == ["--help"]
    assert "cuda_runtime" in env["LD_LIBRARY_PATH"]


def test_perf_analyzer_names_missing_libraries(monkeypatch):
    monkeypatch.setattr(launcher, "_missing_shared_libs", lambda b, e: ["libb64.so.0d"])
    with pytest.raises(launcher.LaunchError, match="libb64.so.0d: apt-get install libb64-0d"):
        launcher.resolve_perf_analyzer([])


def test_advertise_env_from_the_port_flags():
    from tritonguard.ops.launcher import advertise_env

    env = advertise_env(["--model-repository=r", "--http-port=9000", "--grpc-port", "9001",
                         "--metrics-port=9002"], {"TRITONGUARD_ADVERTISE_HOST": "10.1.2.3"})
    assert env["TRITONGUARD_ADVERTISE_HTTP"] == "http://10.1.2.3:9000"
    assert env["TRITONGUARD_ADVERTISE_GRPC"] == "10.1.2.3:9001"
    assert env["TRITONGUARD_ADVERTISE_METRICS"] == "http://10.1.2.3:9002/metrics"
    assert float(env["TRITONGUARD_ADVERTISE_STARTED"]) > 0
    # Triton's defaults and loopback; an operator's own value is kept
    env = advertise_env([], {"TRITONGUARD_ADVERTISE_HTTP": "http://lb:80"})
    assert env["TRITONGUARD_ADVERTISE_HTTP"] == "http://lb:80"
    assert env["TRITONGUARD_ADVERTISE_GRPC"] == "127.0.0.1:8001"
    assert env["TRITONGUARD_ADVERTISE_METRICS"] == "http://127.0.0.1:8002/metrics"
