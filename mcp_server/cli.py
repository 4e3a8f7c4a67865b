"""`curry-train mcp`: start the MCP server on stdio (default) or streamable HTTP bound to 127.0.0.1.

    curry-train mcp                      # stdio: what `claude mcp add curry-train -- curry-train mcp` runs
    curry-train mcp --http --port 8765   # http://127.0.0.1:8765/mcp, Host/Origin checked (DNS-rebinding protection)
    export CURRY_TRAIN_MCP_TOKEN=$(python -c "import secrets; print(secrets.token_urlsafe(32))")
    curry-train mcp --http --token-env CURRY_TRAIN_MCP_TOKEN   # and every request needs
                                                               # `Authorization: Bearer $CURRY_TRAIN_MCP_TOKEN`

HTTP binds to loopback only: the tools launch processes with your privileges. The Host and Origin headers must name
127.0.0.1 / localhost / [::1] with the port (anything else: 421 / 403), so a web page cannot reach the server through
DNS rebinding. Other local users can still connect to a loopback port; `--token-env NAME` closes that: the token is
read from the environment variable NAME (never from the command line, which `ps` shows), compared in constant time,
and a request without it gets 401. Nothing is printed on stdout before the protocol starts; logs go to stderr.
"""

from __future__ import annotations

import argparse
import hmac
import logging
import os
import socket
import sys
from typing import Any

from curry_train.cli.argtypes import port_number

DEFAULT_PORT = 8765
LOOPBACK = ("127.0.0.1", "localhost", "::1")
MIN_TOKEN_CHARS = 16


class BearerAuth:
    """ASGI middleware: every HTTP request must carry `Authorization: Bearer <token>`; others get 401.

    The scheme matches in any case (`bearer`, `BEARER`): RFC 9110 section 11.1 makes auth-schemes
    case-insensitive, and some clients send it lower-case. The token itself is compared exactly, in constant time.
    """

    def __init__(self, app: Any, token: str):
        self.app = app
        self._expected = token.encode()

    def authorized(self, header: bytes) -> bool:
        scheme, _, credentials = header.strip().partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(credentials.strip(b" "), self._expected)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            got = b"".join(v for k, v in scope["headers"] if k == b"authorization")
            if not self.authorized(got):
                body = (b'{"error": "unauthorized: send the header Authorization: Bearer <token>, the token being '
                        b'the value of the variable named by curry-train mcp --token-env"}')
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"www-authenticate", b'Bearer realm="curry-train"'),
                                        (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


def _token(env_name: str | None) -> str | None:
    if env_name is None:
        return None
    token = os.environ.get(env_name, "")
    if len(token) < MIN_TOKEN_CHARS:
        raise SystemExit(f"--token-env {env_name}: set {env_name} to a secret of at least {MIN_TOKEN_CHARS} "
                         f"characters, e.g. export {env_name}=$(python -c \"import secrets; "
                         "print(secrets.token_urlsafe(32))\")")
    return token


def http_app(port: int = DEFAULT_PORT, host: str = "127.0.0.1", token: str | None = None) -> Any:
    """The ASGI app `--http` serves: streamable HTTP at /mcp, DNS-rebinding protection, optional bearer token."""
    from mcp.server.transport_security import TransportSecuritySettings

    from .server import mcp

    if host not in LOOPBACK:
        raise SystemExit("curry-train mcp --http binds to loopback only (it launches jobs with your privileges)")
    security = TransportSecuritySettings(
        enable_dns_rebinding_protection=True,
        allowed_hosts=[f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}"],
        allowed_origins=[f"http://127.0.0.1:{port}", f"http://localhost:{port}", f"http://[::1]:{port}"],
    )
    app = mcp.streamable_http_app(transport_security=security, host=host)
    return BearerAuth(app, token) if token else app


def serve(http: bool = False, port: int = DEFAULT_PORT, host: str = "127.0.0.1", log_level: str = "INFO",
          token_env: str | None = None) -> int:
    logging.basicConfig(level=log_level, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if not http:
        if token_env is not None:
            raise SystemExit("--token-env applies to --http only (stdio is private to the host that started it)")
        from .server import mcp

        mcp.run()
        return 0
    import uvicorn

    app = http_app(port, host, _token(token_env))
    sock = listen(host, port)  # bound before "serving" is logged: a taken port is an error, never a false start
    logging.getLogger(__name__).info("serving MCP on http://%s:%d/mcp%s", host, port,
                                     " (bearer token required)" if token_env else "")
    # What MCPServer.run(transport="streamable-http") does, plus the optional token check around the app.
    uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level.lower())).run(sockets=[sock])
    return 0


def listen(host: str, port: int) -> socket.socket:
    """The bound listening socket, or a one-line error naming the port and the fix (exit 2)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family)
    except OSError as e:
        why = os.strerror(e.errno) if e.errno else str(e)
        print(f"curry-train mcp --http: cannot listen on {host}:{port} ({why}); pass another --port, "
              "or stop the process that holds it", file=sys.stderr)
        raise SystemExit(2) from None


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--http", action="store_true", help="serve streamable HTTP on 127.0.0.1 instead of stdio")
    p.add_argument("--port", type=port_number, default=DEFAULT_PORT,
                   help=f"HTTP only: the 127.0.0.1 port to listen on, 1-65535 (default {DEFAULT_PORT})")
    p.add_argument("--token-env", metavar="NAME", default=None,
                   help="HTTP only: require `Authorization: Bearer <token>`, the token read from environment variable "
                        "NAME (at least 16 characters)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="server log verbosity, written to stderr (stdout carries only the protocol); default INFO")


def _cmd(a: argparse.Namespace) -> int:
    return serve(http=a.http, port=a.port, log_level=a.log_level, token_env=a.token_env)


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("mcp", help="start the MCP server (stdio, or --http on 127.0.0.1)")
    _add_args(p)
    p.set_defaults(fn=_cmd)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="curry-train-mcp", description=__doc__.splitlines()[0])
    _add_args(ap)
    return _cmd(ap.parse_args(argv))
