"""A version routed to while it is still in a slow object store does not stall serving (issue 39
item 2).

A real tritonserver serves the exported ``digits`` guard (in-process target ``digits_raw``) from
moto's S3 server, reached through a throttling TCP proxy on loopback (a slow store on purpose:
reads from the store come back at :data:`RATE` bytes/s). A v2 of the target is published with a
large extra file (:data:`PAD` bytes, generated here, never committed), then the rollout state
(Redis) names it as the candidate. Before the fix the guard's state hook downloaded v2 on the
thread that read the new state, ``execute()``'s included: requests waited for the whole download.
Now the guard's fetcher thread has it downloaded (by a child process for a file this large: see
:func:`tritonguard.core.objectstore.download_in_child`), and v2 gets its share only once it is in
the cache, whole and checked. The test measures the client's latency before, while the same file
is downloaded by a process the guard does not know (the control: the store as busy, the guard
idle), and while v2 is downloading, and checks that no request waited for the download, that the
tail is within a few ms of the control's, and that no target error was counted."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest

from tritonguard.core import objectstore, repository
from tritonguard.ops.server import Server, free_port

pytestmark = pytest.mark.functional

PAD = 256 << 20  # the extra file of v2: hundreds of MB, as a real model's artifact
RATE = 24 << 20  # bytes/s from the store: the download takes ~10 s

# A TCP proxy in its own process (its copying must not share the GIL with the client that times
# requests): upstream -> client bytes are paced to RATE across all connections.
PROXY = r"""
import socket, sys, threading, time
listen, upstream, rate = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
lock = threading.Lock()
clock = [time.monotonic()]

def pace(n):
    with lock:
        now = time.monotonic()
        clock[0] = max(clock[0], now) + n / rate
        wait = clock[0] - now
    if wait > 0:
        time.sleep(wait)

def pipe(src, dst, slow):
    try:
        while True:
            data = src.recv(65536)
            if not data:
                break
            if slow:
                pace(len(data))
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", listen))
srv.listen(64)
print("ready", flush=True)
while True:
    c, _ = srv.accept()
    u = socket.create_connection(("127.0.0.1", upstream))
    threading.Thread(target=pipe, args=(c, u, False), daemon=True).start()
    threading.Thread(target=pipe, args=(u, c, True), daemon=True).start()
"""


def _upload(s3, bucket: str, local, prefix: str) -> None:
    """A model's files as the exporter publishes them: each version's files, then its manifest,
    then the config."""
    files = sorted(p for p in local.rglob("*") if p.is_file())
    rank = {repository.MANIFEST: 1, repository.CONFIG: 2}
    for path in sorted(files, key=lambda p: (rank.get(p.name, 0), str(p))):
        s3.upload_file(str(path), bucket, f"{prefix}/{local.name}/{path.relative_to(local).as_posix()}")


def _metric_sum(url: str, family: str) -> float:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(family))


def _p(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def test_a_large_version_is_fetched_while_the_guard_keeps_serving(exported_repo, moto_s3, redis_server, tmp_path):
    import tritonclient.http as httpclient

    from tritonguard.rollout.state import Candidate
    from tritonguard.rollout.stores import open_store

    bucket = moto_s3.bucket("slow-models")
    s3 = moto_s3.client()
    local = tmp_path / "publish"
    for m in ("digits", "digits_raw"):
        shutil.copytree(exported_repo / m, local / m,
                        ignore=shutil.ignore_patterns("rollout_state.json*", ".*", "__pycache__"))
    repository.write_placeholder(local / "digits" / "1", "digits")
    shutil.rmtree(local / "digits_raw" / "2", ignore_errors=True)
    _upload(s3, bucket, local / "digits_raw", "repo")
    _upload(s3, bucket, local / "digits", "repo")

    proxy_port = free_port()
    proxy_log = tmp_path / "proxy.log"
    proxy = subprocess.Popen([sys.executable, "-c", PROXY, str(proxy_port), str(moto_s3.port), str(RATE)],
                             stdout=subprocess.PIPE, stderr=proxy_log.open("wb"), start_new_session=True)
    srv = None
    try:
        assert proxy.stdout.readline().strip() == b"ready"
        url = f"s3://http://127.0.0.1:{proxy_port}/{bucket}/repo"
        home = tmp_path / "home"
        env = {**os.environ, **moto_s3.env, "TRITONGUARD_STATE_URL": redis_server.url, "TRITONGUARD_HOME": str(home)}
        env.pop("TRITONGUARD_REPOSITORY", None)  # the launcher sets it from --model-repository
        env.pop("AWS_ENDPOINT_URL", None)  # the endpoint is in the URL: the proxy
        srv = Server(repository=url, log_path=tmp_path / "tritonserver.log", env=env,
                     extra_args=["--model-control-mode=explicit", "--load-model=digits", "--exit-timeout-secs=5"])
        srv.start(wait_models=("digits",), timeout=150)

        # v2: v1's files, and a large one beside them (generated here, never committed)
        v2 = local / "digits_raw" / "2"
        shutil.copytree(local / "digits_raw" / "1", v2)
        manifest = json.loads((v2 / repository.MANIFEST).read_text())
        (v2 / repository.MANIFEST).write_text(json.dumps({**manifest, "version": 2}))
        with open(v2 / "weights.bin", "wb") as f:
            f.truncate(PAD)
        for path in sorted(v2.iterdir(), key=lambda p: p.name == repository.MANIFEST):
            s3.upload_file(str(path), bucket, f"repo/digits_raw/2/{path.name}")  # straight to moto: fast

        x = np.full((1, 8, 8), 3.0, np.float32)
        client = httpclient.InferenceServerClient(srv.http_url, connection_timeout=60, network_timeout=60)
        inp = httpclient.InferInput("IMAGE", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        outs = [httpclient.InferRequestedOutput("PROBS"), httpclient.InferRequestedOutput("SERVED_BY")]

        def one() -> tuple[float, str]:
            t0 = time.perf_counter()
            r = client.infer("digits", [inp], outputs=outs)
            took = time.perf_counter() - t0
            return took, r.as_numpy("SERVED_BY")[0][0].decode()

        for _ in range(50):  # warm: first calls, the connection, the metrics thread
            one()
        before: list[float] = []
        t_end = time.monotonic() + 5
        while time.monotonic() < t_end:
            before.append(one()[0])
        # The control: the same file downloaded from the same store by the same code (the
        # guard's child, python -m tritonguard.core.objectstore), into a folder the guard does
        # not read, while the guard serves. The store (moto, the proxy) is another machine's
        # CPU in production but shares these 2 cores here: moto copies the whole object for
        # each ranged GET and used 9.4 CPU-s of a 12 s download (sampled from /proc,
        # 2026-11-29). The guard's own fetch is judged against this, not against a quiet machine.
        job = {"bucket": bucket, "prefix": "repo", "endpoint": f"http://127.0.0.1:{proxy_port}",
               "rel": "digits_raw/2/weights.bin", "dest": str(tmp_path / "control" / "weights.bin")}
        # each window starts with nothing of the one before still to be written back: the control
        # writes 256 MB that the kernel flushes up to 30 s later (vm.dirty_expire_centisecs),
        # which otherwise lands in the window of the guard's fetch, not in the control's own
        os.sync()
        control_dl = subprocess.Popen([sys.executable, "-m", "tritonguard.core.objectstore"], env=env,
                                      stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        control_dl.stdin.write(json.dumps(job))
        control_dl.stdin.close()
        control: list[float] = []
        t_end = time.monotonic() + 120  # bounded: the download takes ~PAD / RATE
        while control_dl.poll() is None and time.monotonic() < t_end:
            control.append(one()[0])
        assert control_dl.wait(timeout=10) == 0, control_dl.stderr.read()
        assert (tmp_path / "control" / "weights.bin").stat().st_size == PAD

        os.sync()
        store = open_store("digits", tmp_path, url=redis_server.url)

        def name_v2(s):
            s.candidate = Candidate(2, 0.5)
            return s

        store.update(name_v2, by="test")
        named_at = time.monotonic()
        during: list[float] = []
        served: dict[str, int] = {}
        fetched_s = None
        t_end = named_at + 120  # bounded: the download takes ~PAD / RATE
        while time.monotonic() < t_end:
            took, who = one()
            served[who] = served.get(who, 0) + 1
            if who == "digits_raw:2":
                fetched_s = time.monotonic() - named_at
                break
            during.append(took)
        after: list[float] = []
        t_end = time.monotonic() + 3
        while time.monotonic() < t_end:
            took, who = one()
            served[who] = served.get(who, 0) + 1
            after.append(took)
        client.close()

        figures = {
            "download_s": round(fetched_s, 2) if fetched_s else None,
            "before": {"n": len(before), "p50_ms": round(_p(before, 50) * 1e3, 2),
                       "p99_ms": round(_p(before, 99) * 1e3, 2), "max_ms": round(max(before) * 1e3, 2)},
            "control": {"n": len(control), "p50_ms": round(_p(control, 50) * 1e3, 2),
                        "p99_ms": round(_p(control, 99) * 1e3, 2), "max_ms": round(max(control) * 1e3, 2)},
            "during": {"n": len(during), "p50_ms": round(_p(during, 50) * 1e3, 2),
                       "p99_ms": round(_p(during, 99) * 1e3, 2), "max_ms": round(max(during) * 1e3, 2)},
            "after": {"n": len(after), "p99_ms": round(_p(after, 99) * 1e3, 2)},
            "served": served,
        }
        print(f"\nserving while v2 ({PAD >> 20} MB) is fetched at {RATE >> 20} MB/s: {json.dumps(figures)}")
        assert fetched_s is not None, f"v2 was never served: {figures}"
        # the store really was slow: the test is meaningless if the download took no time
        assert fetched_s > 0.5 * PAD / RATE, figures
        # no request waited for the download: the slowest one during it took a small fraction
        assert max(during) < fetched_s / 10, figures
        # and the tail stays within a few ms of where it was with the store equally busy (the
        # control). The download runs in a child process (its Python code no longer takes the GIL
        # from execute(): in process, p99 rose from 7 to 20 ms in a full run). Against a quiet
        # machine the store's own CPU was counted against the guard: a CI run read 9.1 ms during
        # the fetch, 3.1 ms before it, and failed. With the control, two runs here (2026-11-29):
        # before 3.3 / 3.2 ms, control 5.5 / 5.8 ms, during 5.8 / 5.0 ms. The 5 ms (or one p99
        # of the quiet machine, when its own noise is above 5 ms) are the allowance, as before.
        p99_before = _p(before, 99)
        assert _p(during, 99) < _p(control, 99) + max(0.005, p99_before), figures
        # v2 got its share once it was here; meanwhile its share was v1's, and nothing was counted
        assert served.get("digits_raw:2", 0) > 0 and served.get("digits_raw:1", 0) > 0
        assert _metric_sum(srv.metrics_url, "tritonguard_target_errors_total") == 0
        assert _metric_sum(srv.metrics_url, "tritonguard_fallbacks_total") == 0
        state = store.load()
        assert state.candidate is not None and state.candidate.version == 2
        assert state.breakers.get("2", {}).get("state", "closed") == "closed"
        deadline = time.monotonic() + 15  # the reconciler's golden check of v2, on its own thread
        while "2" not in state.goldens and time.monotonic() < deadline:
            time.sleep(0.2)
            state = store.load()
        assert state.goldens["2"]["verdict"] != "FAIL"
        cached = home / "cache" / "objstore" / objectstore.parse(url, {}).cache_key / "digits_raw" / "2"
        assert (cached / "weights.bin").stat().st_size == PAD and (cached / repository.MANIFEST).exists()
        assert not any((cached.parent.parent / ".staging").iterdir())  # nothing of the download left
    finally:
        if srv is not None:
            srv.stop()
        proxy.terminate()
        proxy.wait(timeout=10)
