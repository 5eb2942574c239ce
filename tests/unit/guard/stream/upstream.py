"""A real OpenAI-compatible server this project does not write, for tests: ``transformers serve``
on a tiny random GPT-2 built offline, on a loopback port (tests/unit/guard/stream/
test_openai_target.py, tests/functional/test_generation_rollout.py)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.processes import stop_process

# a tiny GPT-2 with a byte-level BPE tokenizer trained on one sentence: random weights, no network
BUILD = r"""
import sys, torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
tok.train_from_iterator(["hello world the quick brown fox jumps over the lazy dog"] * 10, trainer)
fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>")
fast.save_pretrained(sys.argv[1])
torch.manual_seed(0)
GPT2LMHeadModel(GPT2Config(vocab_size=len(fast), n_positions=4096, n_embd=16, n_layer=1, n_head=2,
                           bos_token_id=fast.eos_token_id, eos_token_id=fast.eos_token_id)).save_pretrained(sys.argv[1])
"""
# `transformers serve` as shipped, except that its model manager always passes --device as
# device_map, which needs `accelerate` (not installed here): the model loads with none, on the CPU
SERVE = r"""
import sys
from transformers.cli.serving import model_manager as mm
_load = mm.ModelManager._load_model
def _load_cpu(self, *a, **k):
    device, self.device = self.device, None
    try:
        return _load(self, *a, **k)
    finally:
        self.device = device
mm.ModelManager._load_model = _load_cpu
from transformers.cli.transformers import main
sys.argv = ["transformers", "serve", *sys.argv[1:]]
sys.exit(main())
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def transformers_serve(root: Path) -> Iterator[tuple[str, str]]:
    """(base URL, model name) of a real `transformers serve` on a loopback port, answering;
    stopped (by its PID) on exit; the test is skipped where its packages are missing."""
    with transformers_serve_starting(root) as (url, model, ready):
        ready()
        yield url, model


@contextlib.contextmanager
def transformers_serve_starting(root: Path) -> Iterator[tuple[str, str, Callable[[], None]]]:
    """(base URL, model name, ``ready``) of a `transformers serve` that is still starting (its
    model built and loaded in its own process, one import of torch and transformers for both):
    a test does what does not need it meanwhile, then calls ``ready()``, which waits (at most
    180 s) until it answers. Stopped (by its PID) on exit."""
    for mod in ("torch", "transformers", "tokenizers", "fastapi", "uvicorn"):
        if importlib.util.find_spec(mod) is None:
            pytest.skip(f"transformers serve needs {mod}")
    root.mkdir(parents=True, exist_ok=True)
    model = root / "tiny-gpt2"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    port = free_port()
    log = open(root / "serve.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-c", BUILD + SERVE, str(model), "--host", "127.0.0.1", "--port",
                             str(port), "--device", "cpu", "--log-level", "info"],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180 + 300  # the build's own limit (300 s) and the server's start

    def ready() -> None:
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail("transformers serve did not start: " + (root / "serve.log").read_text()[-2000:])
            time.sleep(0.5)

    try:
        yield f"http://127.0.0.1:{port}/v1", str(model), ready
    finally:
        stop_process(proc)
        log.close()
