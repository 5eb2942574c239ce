"""``--server``: one rule for every command that talks to Triton.

A URL with a scheme says the protocol: ``http://HOST:PORT`` (or ``https://``) is Triton's HTTP
endpoint, ``grpc://HOST:PORT`` its gRPC endpoint, in every command. A bare ``HOST:PORT`` keeps
what it has always meant for that command: HTTP for ``promote``, ``rollback``, ``rollout`` and
``status`` (they load models and read health and metrics over HTTP), gRPC for ``batch`` (it scores
over gRPC). A command given the other protocol's endpoint finds its own on the same host by
Triton's default port layout (HTTP, gRPC and metrics on consecutive ports: 8000, 8001, 8002), as
the metrics URL is already found at the HTTP port + 2, and says so on stderr; where the server
was started with other ports, name the endpoint the command speaks.
"""

from __future__ import annotations

from urllib.parse import urlsplit

import typer
from rich.markup import escape

from exporter.cli.consoles import WideConsole

HTTP, GRPC = "http", "grpc"
SCHEMES = {"http": HTTP, "https": HTTP, "grpc": GRPC}
# Triton's default layout: --http-port 8000, --grpc-port 8001 (--metrics-port 8002)
_OFFSET = {(GRPC, HTTP): -1, (HTTP, GRPC): +1}
NAMES = {HTTP: "HTTP", GRPC: "gRPC"}
_err = WideConsole(stderr=True, soft_wrap=True)


def help_text(protocol: str, what: str) -> str:
    """The rule, as each command's ``--server`` help says it."""
    return (f"{what} A bare HOST:PORT is Triton's {NAMES[protocol]} endpoint here; http://HOST:PORT and grpc://HOST:PORT "
            "mean HTTP and gRPC in every command (the other protocol's port is found by Triton's default "
            "layout: gRPC = HTTP + 1).")


def address(value: str, protocol: str) -> tuple[str, str | None]:
    """``value`` as this command's ``protocol`` needs it: for HTTP a URL or a bare ``host:port``
    (read as ``http://``, :func:`exporter.rollout.serving.server_url`), for gRPC ``host:port``
    (what tritonclient.grpc takes). Returns (address, note), the note saying which port was
    derived from the other protocol's, else None. ValueError when it cannot be read or converted."""
    value = value.strip()
    if "://" not in value:
        return value, None  # the command's own protocol, as before
    scheme = value.split("://", 1)[0].lower()
    given = SCHEMES.get(scheme)
    if given is None:
        raise ValueError(f"{value!r}: the scheme is http://, https:// or grpc://")
    if given == protocol:
        return (value if protocol == HTTP else value.split("://", 1)[1].rstrip("/")), None
    parts = urlsplit(value)
    try:
        port = parts.port
    except ValueError:
        port = None
    if not parts.hostname or port is None or parts.path.strip("/"):
        raise ValueError(f"{value!r}: this command speaks {NAMES[protocol]}; give HOST:PORT with the port, "
                         "or the URL of that endpoint")
    if scheme == "https":
        raise ValueError(f"{value!r}: gRPC here is without TLS; pass grpc://HOST:PORT")
    host = parts.netloc.rsplit(":", 1)[0]
    derived = port + _OFFSET[(given, protocol)]
    out = f"http://{host}:{derived}" if protocol == HTTP else f"{host}:{derived}"
    return out, f"--server {value}: {NAMES[protocol]} at {out} (Triton's default port layout)"


def servers(protocol: str):
    """A typer callback for a repeated ``--server``: each value as :func:`address` makes it; a
    value that cannot be read is a usage error (exit 2)."""

    def convert(values: list[str] | None) -> list[str] | None:
        if not values:
            return values
        out = []
        for value in values:
            try:
                addr, note = address(value, protocol)
            except ValueError as exc:
                raise typer.BadParameter(str(exc)) from None
            if note:
                _err.print(f"[dim]{escape(note)}[/]")
            out.append(addr)
        return out

    return convert


__all__ = ["GRPC", "HTTP", "address", "help_text", "servers"]
