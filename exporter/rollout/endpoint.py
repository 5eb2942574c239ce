"""``python -m exporter.rollout.endpoint GUARD VERSION --url URL``: declare that version VERSION
of the guard's target is served by an OpenAI-compatible server at URL (vLLM, TGI, ``transformers
serve``), in ``<repository>/<target>/endpoints.json`` (:mod:`tritonguard.rollout.endpoints`).

The version is then a version like the others to ``exporter promote``, ``route`` and
``rollback``: the guard calls it at the URL (whatever its placement), canary and shadow traffic
reach it, ``served_by`` names it, and the live gates judge it on what the guards measure through
that server (there is nothing to run offline). ``--remove`` withdraws a declaration. The API key
is never written: ``--api-key-env`` / ``--api-key-file`` say where each guard reads it.
Exit codes: 0 done, 2 bad input (one line).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from exporter.rollout.guards import NotAGuard, guard_target
from tritonguard.rollout.endpoints import JUDGES, Endpoint, EndpointError, declare, withdraw


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m exporter.rollout.endpoint",
                                 description="Declare (or --remove) a version of a stream guard's target served "
                                             "at the URL of an OpenAI-compatible server.")
    ap.add_argument("guard", help="the stream guard (its config.pbtxt names the target)")
    ap.add_argument("version", type=int, help="the version number (not a version folder of the target)")
    ap.add_argument("--url", default="", help="the server's base URL, http(s)://host:port/v1")
    ap.add_argument("--model", default="", help="the model name the server serves (default: the target's name)")
    ap.add_argument("--api-key-env", default="", help="environment variable the guards read its API key from")
    ap.add_argument("--api-key-file", default="", help="file the guards read its API key from")
    ap.add_argument("--judge", choices=JUDGES, default="task",
                    help="how a rollout compares it with the primary (default: task)")
    ap.add_argument("--remove", action="store_true", help="withdraw the declaration")
    ap.add_argument("--repository", type=Path, default=Path("model_repository"))
    args = ap.parse_args(argv)

    def bad(message: str) -> int:
        sys.stderr.write(f"error: {message}\n")
        return 2

    try:
        target = guard_target(args.repository, args.guard)
    except NotAGuard as exc:
        return bad(str(exc))
    folder = args.repository / target
    try:
        if args.remove:
            if not withdraw(folder, args.version):
                return bad(f"v{args.version} of '{target}' is not declared at a URL")
            sys.stdout.write(f"{args.guard}: v{args.version} of '{target}' is no longer served at a URL\n")
            return 0
        if not args.url:
            return bad("--url is required (or --remove)")
        endpoint = Endpoint(version=args.version, url=args.url, model=args.model, api_key_env=args.api_key_env,
                            api_key_file=args.api_key_file, judge=args.judge)
        declare(folder, endpoint)
    except EndpointError as exc:
        return bad(str(exc))
    sys.stdout.write(f"{args.guard}: v{args.version} of '{target}' is served at {endpoint.url} "
                     f"(model {endpoint.model or target!r}); roll it out with "
                     f"`python -m exporter promote {args.guard} --version {args.version} --server …`\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
