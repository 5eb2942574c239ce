"""``python -m tritonguard.llm --server HOST:PORT --model GUARD [--model GUARD2] [--port 8000]``:
serve the OpenAI-compatible front (:mod:`tritonguard.llm.app`) with uvicorn, on 127.0.0.1 unless
``--host`` says otherwise. ``python -m exporter openai`` runs this (as a process of its own: the
exporter never imports the serving stack). Exit 2 on bad arguments."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

EXIT_BAD_INPUT = 2


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m tritonguard.llm", description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", required=True, help="Triton gRPC address of the guard, HOST:PORT")
    ap.add_argument("--model", action="append", required=True,
                    help="a decoupled stream guard to serve (repeat for more); the request's 'model' picks one")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    ap.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    ap.add_argument("--tokenizer", type=Path, default=None,
                    help="a Hugging Face tokenizer folder: the model's chat template and token counts "
                         "(default: the plain template, a token per character)")
    ap.add_argument("--keys-file", type=Path, default=None,
                    help="for a guard without tenancy.auth: tenant -> SHA-256 digests of its API keys "
                         "(tenancy.keys_file's format); the front checks the bearer key and names the tenant")
    ap.add_argument("--idle-timeout-s", type=float, default=60.0,
                    help="longest wait for the guard's next response (default 60)")
    ap.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    return ap


def check(args: argparse.Namespace) -> str | None:
    """Why the arguments cannot work (one line), or None."""
    host, sep, port = args.server.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return f"--server must be HOST:PORT, got {args.server!r}"
    if not 0 < args.port < 65536:
        return f"--port must lie in 1..65535, got {args.port}"
    if len(set(args.model)) != len(args.model) or not all(m.strip() for m in args.model):
        return "--model: each guard once, and not empty"
    if args.tokenizer is not None and not args.tokenizer.is_dir():
        return f"--tokenizer {args.tokenizer}: not a folder"
    if args.keys_file is not None and not args.keys_file.is_file():
        return f"--keys-file {args.keys_file}: no such file"
    if not args.idle_timeout_s > 0:
        return "--idle-timeout-s must be > 0"
    return None


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    why = check(args)
    if why is not None:
        sys.stderr.write(f"error: {why}\n")
        return EXIT_BAD_INPUT
    import uvicorn  # noqa: PLC0415 - after the arguments are checked

    from tritonguard.core.errors import ConfigError  # noqa: PLC0415
    from tritonguard.llm.app import FrontConfig, build_app  # noqa: PLC0415
    from tritonguard.llm.template import ChatTemplate  # noqa: PLC0415
    from tritonguard.privacy.tenancy.auth import ApiKeys  # noqa: PLC0415
    from tritonguard.privacy.tenancy.config import TenancyConfig  # noqa: PLC0415

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        template = ChatTemplate.load(args.tokenizer)
        keys = None
        if args.keys_file is not None:
            keys = ApiKeys(TenancyConfig(auth="api_key", keys_file=str(args.keys_file)))
    except (ValueError, ConfigError) as exc:
        sys.stderr.write(f"error: {exc}\n")
        return EXIT_BAD_INPUT
    app = build_app(FrontConfig(server=args.server, models=list(args.model), template=template, keys=keys,
                                idle_timeout_s=args.idle_timeout_s))
    logging.getLogger(__name__).info("OpenAI front on http://%s:%d/v1 -> %s %s (chat template: %s)", args.host,
                                     args.port, args.server, ", ".join(args.model), template.source)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
