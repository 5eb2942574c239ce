"""Reproduce Triton 2.51's stop that waits its whole exit timeout after cancelled gRPC streams.

A decoupled model that finishes a stream (its last responses and the final flag) after the client
has cancelled it can stay counted live: the next server stop waits ``--exit-timeout-secs`` (30 s)
with ``Found 1 live models``. This script starts a real tritonserver on loopback, opens
``--streams`` gRPC streams one after another, closes each after its first 1..``--cut-after``
responses (``call.cancel()``, as the OpenAI front closed one until 2026-11-30; ``--close stop``:
a stop request, as it does now), then stops the server and times the stop; ``--tries`` times.
``--load N`` runs N busy loops beside it (2: the machine's two cores taken, as the test lanes take
them; stopped by PID at the end).

Targets: ``minimal``, a 15-line decoupled python model that is not ours (``--max-tokens``
responses, no cancel check); ``tinylm``, this project's ``generator`` backend; ``tinylm_guard``,
the stream guard in front of it (in process). The last two need a tinylm training (~20 s).

    .venv/bin/python tools/repro_cancel_stall.py --target minimal --max-tokens 5 --cut-after 1 --load 2
"""

from __future__ import annotations

import argparse
import asyncio
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MINIMAL_MODEL = '''
import time
import numpy as np
import triton_python_backend_utils as pb_utils
class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy().reshape(-1)[0])
            sender = request.get_response_sender()
            for i in range(n):
                out = pb_utils.Tensor("OUT", np.array([i], dtype=np.int32))
                sender.send(pb_utils.InferenceResponse(output_tensors=[out]))
                time.sleep(0.001)
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
'''
MINIMAL_CONFIG = '''name: "minimal"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
'''


def build(repo: Path, target: str) -> tuple[str, ...]:
    """The repository for ``target``; returns the models to wait for."""
    if target == "minimal":
        (repo / "minimal" / "1").mkdir(parents=True)
        (repo / "minimal" / "1" / "model.py").write_text(MINIMAL_MODEL)
        (repo / "minimal" / "config.pbtxt").write_text(MINIMAL_CONFIG)
        return ("minimal",)
    from examples import generator as example  # noqa: PLC0415 - torch only when tinylm is asked for
    from tritonguard.core.repository import write_config  # noqa: PLC0415

    example.build(repo, "tinylm", steps=40)
    cfg = example.stream_guard_config("tinylm_guard", "tinylm", placement="inprocess", validation__max_tokens="256")
    write_config(repo / "tinylm_guard", cfg)
    (repo / "tinylm_guard" / "1").mkdir()
    return ("tinylm", "tinylm_guard")


async def cut(client, request: dict, cut_after: int) -> None:
    """One stream of ``request``, cancelled after its first 1..``cut_after`` responses (unless its
    final response came first: then there is nothing to cancel)."""
    done = asyncio.Event()

    async def requests():
        yield request
        await done.wait()

    call = client.stream_infer(requests())
    final = False
    for _ in range(random.randint(1, cut_after)):
        result, error = await call.__anext__()
        params = result.get_response().parameters if error is None else {}
        if error is not None or ("triton_final_response" in params and params["triton_final_response"].bool_param):
            final = True
            break
    done.set()
    if not final:
        call.cancel()


async def minimal_streams(url: str, n: int, responses: int, cut_after: int) -> None:
    import numpy as np  # noqa: PLC0415
    import tritonclient.grpc.aio as grpcclient  # noqa: PLC0415

    client = grpcclient.InferenceServerClient(url)
    try:
        for _ in range(n):
            inp = grpcclient.InferInput("IN", [1], "INT32")
            inp.set_data_from_numpy(np.array([responses], dtype=np.int32))
            await cut(client, {"model_name": "minimal", "inputs": [inp],
                               "parameters": {"triton_enable_empty_final_response": True}}, cut_after)
    finally:
        await client.close()


async def guard_streams(url: str, model: str, n: int, max_tokens: int, cut_after: int, close: str) -> None:
    """``n`` answers of ``model``, each left after its first 1..``cut_after`` pieces: ``cancel``
    cancels the gRPC stream (what the OpenAI front did until 2026-11-30); ``stop`` is the front's
    own client now (:class:`~tritonguard.llm.upstream.Upstream`: a stop request, the stream read
    to its end)."""
    from tritonguard.llm.upstream import Upstream, _inputs  # noqa: PLC0415

    if close == "stop":
        up = Upstream(url)
        try:
            for _ in range(n):
                gen = up.generate(model, "Return the", True, {"max_tokens": max_tokens}, {})
                k, got = random.randint(1, cut_after), 0
                async for _piece in gen:
                    got += 1
                    if got >= k:
                        break
                await gen.aclose()  # an answer not over yet: the guard is asked to stop it
        finally:
            await up.close()
        return
    import tritonclient.grpc.aio as grpcclient  # noqa: PLC0415

    client = grpcclient.InferenceServerClient(url)
    try:
        for _ in range(n):
            await cut(client, {"model_name": model, "inputs": _inputs("Return the", True, {"max_tokens": max_tokens}),
                               "parameters": {"triton_enable_empty_final_response": True}}, cut_after)
    finally:
        await client.close()


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", choices=("minimal", "tinylm", "tinylm_guard"), default="minimal")
    ap.add_argument("--max-tokens", type=int, default=5, help="responses (minimal) or tokens per answer")
    ap.add_argument("--cut-after", type=int, default=1, help="leave after 1..N responses")
    ap.add_argument("--close", choices=("cancel", "stop"), default="cancel",
                    help="how a guard's or tinylm's stream is left: cancelled, or a stop request (the OpenAI front's way)")
    ap.add_argument("--streams", type=int, default=80)
    ap.add_argument("--tries", type=int, default=3)
    ap.add_argument("--load", type=int, default=0, metavar="N", help="N busy loops beside the server")
    args = ap.parse_args()

    from tritonguard.ops.server import Server  # noqa: PLC0415

    base = Path(tempfile.mkdtemp(prefix="cancel-stall-"))
    wait = build(base / "repo", args.target)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    slow = 0
    try:
        for t in range(args.tries):
            srv = Server(repository=base / "repo", log_path=base / f"tritonserver-{t}.log")
            srv.start(wait_models=wait)
            try:
                if args.target == "minimal":
                    asyncio.run(minimal_streams(srv.grpc_url, args.streams, args.max_tokens, args.cut_after))
                else:
                    asyncio.run(guard_streams(srv.grpc_url, args.target, args.streams, args.max_tokens,
                                              args.cut_after, args.close))
                time.sleep(1)
            finally:
                t0 = time.monotonic()
                srv.stop()
                took = time.monotonic() - t0
            slow += took > 20
            log = srv.log_path.read_text(errors="replace")
            seen = (f"; the guard saw {log.count('client cancelled after')} cancels, "
                    f"{log.count('client asked to stop after')} stops" if args.target == "tinylm_guard" else "")
            how = "cancelled" if args.target == "minimal" or args.close == "cancel" else "stopped"
            say(f"try {t + 1}: {args.target}, {args.streams} streams {how} after 1..{args.cut_after} "
                f"responses: the server stopped in {took:.1f} s{seen} (log {srv.log_path})")
    finally:
        for p in busy:
            p.kill()
            p.wait()
    say(f"{slow} of {args.tries} stops waited the exit timeout")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
