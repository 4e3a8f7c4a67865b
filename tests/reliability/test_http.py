"""The HTTP transport: loopback only, DNS-rebinding protection, an optional bearer token.

    .venv/bin/pytest tests/reliability/test_http.py -q

One server is started with `curry-train mcp --http --port P --token-env NAME`: the test checks from /proc that it
listens on 127.0.0.1 only, that requests without the token (or with a wrong one) get 401, that with the token a
foreign Host header gets 421 and a foreign Origin 403, and that a real MCP client with the token works.
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import time
from pathlib import Path

import anyio
import httpx2
import pytest
from curry_train_mcp.cli import BearerAuth, http_app
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from rel_support import SERVER, server_env

from tests.conftest import shipped_configs

pytestmark = pytest.mark.slow

TOKEN_ENV = "CURRY_TRAIN_TEST_TOKEN"
MCP_HEADERS = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
INIT = (b'{"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"protocolVersion": "2025-11-25", '
        b'"capabilities": {}, "clientInfo": {"name": "t", "version": "0"}}}')


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening_addresses(port: int) -> set[str]:
    """Local addresses with a socket listening on port, from /proc/net/tcp and tcp6 (state 0A = LISTEN)."""
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not Path(table).exists():
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, hexport = local.split(":")
            if int(hexport, 16) == port and state == "0A":
                out.add(addr)
    return out


@pytest.fixture(scope="module")
def token_server(tmp_path_factory):
    project = tmp_path_factory.mktemp("http")
    shipped_configs(project / "configs")  # a copy: the server never sees the checkout's configs/
    (project / "runs").mkdir()
    token = secrets.token_urlsafe(32)
    port = _free_port()
    proc = subprocess.Popen([*SERVER, "--http", "--port", str(port), "--token-env", TOKEN_ENV, "--log-level",
                             "WARNING"], cwd=project, env=server_env(project, **{TOKEN_ENV: token}),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not _listening_addresses(port):
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        assert time.monotonic() < deadline, "the HTTP server never listened"
        time.sleep(0.1)
    yield port, token
    proc.terminate()
    proc.wait(30)


def test_http_listens_on_loopback_only(token_server):
    port, _ = token_server
    assert _listening_addresses(port) == {"0100007F"}, "bound beyond 127.0.0.1"  # 127.0.0.1, little-endian hex


def test_http_refuses_to_bind_beyond_loopback():
    for host in ("0.0.0.0", "::", "192.168.1.10", "example.com"):
        with pytest.raises(SystemExit, match="loopback only"):
            http_app(port=8765, host=host)


@pytest.mark.anyio
async def test_requests_without_the_bearer_token_get_401(token_server):
    port, token = token_server
    url = f"http://127.0.0.1:{port}/mcp"
    async with httpx2.AsyncClient() as h:
        for auth in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": token},
                     {"Authorization": f"Basic {token}"}, {"Authorization": f"Bearer {token}x"}):
            r = await h.post(url, headers={**MCP_HEADERS, **auth}, content=INIT)
            assert r.status_code == 401, (auth, r.status_code, r.text[:200])
            assert r.headers["www-authenticate"].startswith("Bearer") and "token-env" in r.text
        r = await h.get(f"http://127.0.0.1:{port}/anything-else")
        assert r.status_code == 401  # every path, not only /mcp


@pytest.mark.anyio
async def test_dns_rebinding_a_foreign_host_or_origin_is_refused_even_with_the_token(token_server):
    port, token = token_server
    url = f"http://127.0.0.1:{port}/mcp"
    auth = {"Authorization": f"Bearer {token}"}
    async with httpx2.AsyncClient() as h:
        for host in ("evil.example.com", f"evil.example.com:{port}", "localhost", "127.0.0.1", f"10.0.0.1:{port}",
                     f"127.0.0.1.evil.example.com:{port}"):
            r = await h.post(url, headers={**MCP_HEADERS, **auth, "Host": host}, content=INIT)
            assert r.status_code == 421, (host, r.status_code)
        r = await h.post(url, headers={**MCP_HEADERS, **auth, "Origin": "http://evil.example.com"}, content=INIT)
        assert r.status_code == 403, r.status_code
        r = await h.post(url, headers={**MCP_HEADERS, **auth, "Origin": f"http://localhost:{port}"}, content=INIT)
        assert r.status_code == 200, (r.status_code, r.text[:300])


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["auto", "legacy"])
async def test_a_client_with_the_token_can_use_the_tools(token_server, mode):
    port, token = token_server
    async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=60) as h:
        with anyio.fail_after(60):
            async with Client(streamable_http_client(f"http://127.0.0.1:{port}/mcp", http_client=h),
                              mode=mode) as c:
                assert "estimate_memory" in {t.name for t in (await c.list_tools()).tools}
                r = await c.call_tool("estimate_memory", {"config": "tiny"})
                assert not r.is_error and r.structured_content["memory"]["total"] > 0


@pytest.mark.parametrize("value", [None, "", "short"])
def test_a_missing_or_weak_token_stops_the_server_before_it_listens(tmp_path, value):
    env = server_env(tmp_path)
    env.pop(TOKEN_ENV, None)
    if value is not None:
        env[TOKEN_ENV] = value
    r = subprocess.run([*SERVER, "--http", "--port", str(_free_port()), "--token-env", TOKEN_ENV], env=env,
                       cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode != 0 and TOKEN_ENV in r.stderr and "16" in r.stderr, r.stderr[-500:]


@pytest.mark.anyio
async def test_the_token_check_is_plain_asgi_and_passes_lifespan_through():
    """BearerAuth in isolation: 401 without the header, the wrapped app with it, non-HTTP scopes untouched."""
    calls = []

    async def app(scope, receive, send):
        calls.append(scope["type"])

    sent = []

    async def send(msg):
        sent.append(msg)

    guard = BearerAuth(app, "t" * 20)
    await guard({"type": "http", "headers": []}, None, send)
    assert sent[0]["status"] == 401 and calls == []
    await guard({"type": "http", "headers": [(b"authorization", b"Bearer " + b"t" * 20)]}, None, send)
    await guard({"type": "lifespan"}, None, send)
    assert calls == ["http", "lifespan"]
    assert os.environ.get(TOKEN_ENV) is None  # the test never leaks the token into this process
