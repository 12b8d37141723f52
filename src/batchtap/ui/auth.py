"""Who may read: a token checked on every request, and loopback-only Host names without one.

Bound to 127.0.0.1 the UI needs no token, as Jupyter's "no token on localhost" would; any other
host needs one (generated and printed by ``serve`` when not given). The token travels as
``?token=`` once (the printed link), after which a cookie carries it: an ``EventSource`` cannot
send headers, and cookies travel with it. ``Authorization: Bearer <token>`` works for scripts.

Without a token only the Host names of the loopback interface are answered, so a web page that
rebinds its own DNS name to 127.0.0.1 cannot read the runs through the browser.
"""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any
from urllib.parse import parse_qs

__all__ = ["COOKIE", "TokenGate", "new_token", "is_loopback"]

COOKIE = "batchtap_ui_token"
_LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def new_token() -> str:
    """A fresh random token (32 bytes, URL-safe)."""
    return secrets.token_urlsafe(32)


def is_loopback(host: str) -> bool:
    """Whether a bind address or Host name is this machine's loopback.

    Example:
        >>> is_loopback("127.0.0.1"), is_loopback("0.0.0.0"), is_loopback("127.0.0.2")
        (True, False, True)
    """
    return host in _LOOPBACK_NAMES or host.startswith("127.")


class TokenGate:
    """ASGI middleware: refuse (401) any HTTP request without the token, or (403) any request
    whose Host is not loopback when there is no token."""

    def __init__(self, app: ASGIApp, token: str | None) -> None:
        self.app = app
        self.token = token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if self.token is None:
            if not is_loopback(_host_name(headers.get("host", ""))):
                await _refuse(send, 403, "this server answers only on its loopback names (127.0.0.1, localhost)")
                return
            await self.app(scope, receive, send)
            return
        given = _token_from(scope, headers)
        if given is None or not secrets.compare_digest(given.encode(), self.token.encode()):
            await _refuse(
                send,
                401,
                "a token is required: open the link `batchtap ui` printed (it ends in ?token=...), "
                "or send the header 'Authorization: Bearer <token>'",
            )
            return
        from_query = "token" in parse_qs(scope.get("query_string", b"").decode("latin-1"))

        async def send_with_cookie(message: MutableMapping[str, Any]) -> None:
            if from_query and message["type"] == "http.response.start":
                cookie = f"{COOKIE}={self.token}; Path=/; HttpOnly; SameSite=Strict"
                message["headers"] = [*message.get("headers", []), (b"set-cookie", cookie.encode("latin-1"))]
            await send(message)

        await self.app(scope, receive, send_with_cookie)


def _host_name(host: str) -> str:
    if host.startswith("["):
        return host.split("]", 1)[0] + "]"
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _token_from(scope: Scope, headers: dict[str, str]) -> str | None:
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    if "token" in query:
        return query["token"][0]
    auth = headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    for part in headers.get("cookie", "").split(";"):
        name, _, value = part.strip().partition("=")
        if name == COOKIE:
            return value
    return None


async def _refuse(send: Send, status: int, message: str) -> None:
    body = f"batchtap ui: {message}\n".encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"text/plain; charset=utf-8"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})
