"""`curry-train mcp`: start the MCP server on stdio (default) or streamable HTTP bound to 127.0.0.1.

    curry-train mcp                      # stdio: what `claude mcp add curry-train -- curry-train mcp` runs
    curry-train mcp --http --port 8765   # http://127.0.0.1:8765/mcp, Host/Origin checked (DNS-rebinding protection)

Nothing is printed on stdout before the protocol starts; logs go to stderr.
"""

from __future__ import annotations

import argparse
import logging
import sys

DEFAULT_PORT = 8765


def serve(http: bool = False, port: int = DEFAULT_PORT, host: str = "127.0.0.1", log_level: str = "INFO") -> int:
    logging.basicConfig(level=log_level, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from .server import mcp

    if not http:
        mcp.run()
        return 0
    from mcp.server.transport_security import TransportSecuritySettings

    if host not in ("127.0.0.1", "localhost", "::1"):
        raise SystemExit("curry-train mcp --http binds to loopback only (it launches jobs with your privileges)")
    security = TransportSecuritySettings(
        enable_dns_rebinding_protection=True,
        allowed_hosts=[f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}"],
        allowed_origins=[f"http://127.0.0.1:{port}", f"http://localhost:{port}", f"http://[::1]:{port}"],
    )
    logging.getLogger(__name__).info("serving MCP on http://%s:%d/mcp", host, port)
    mcp.run(transport="streamable-http", host=host, port=port, transport_security=security)
    return 0


def _cmd(a: argparse.Namespace) -> int:
    return serve(http=a.http, port=a.port, log_level=a.log_level)


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("mcp", help="start the MCP server (stdio, or --http on 127.0.0.1)")
    p.add_argument("--http", action="store_true", help="serve streamable HTTP instead of stdio")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"HTTP port (default {DEFAULT_PORT})")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    p.set_defaults(fn=_cmd)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="curry-train-mcp", description=__doc__.splitlines()[0])
    ap.add_argument("--http", action="store_true")
    ap.add_argument("--port", type=int, default=DEFAULT_PORT)
    ap.add_argument("--log-level", default="INFO")
    a = ap.parse_args(argv)
    return serve(http=a.http, port=a.port, log_level=a.log_level)
