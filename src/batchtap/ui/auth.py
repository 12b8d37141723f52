"""Who may read: a token checked on every request, and loopback-only Host names without one.

Bound to 127.0.0.1 the UI needs no token, as Jupyter's "no token on localhost" would; any other
host needs one (generated and printed by ``serve`` when not given). The token travels as
``?token=`` once (the printed link), after which a cookie carries it: an ``EventSource`` cannot
send headers, and cookies travel with it. ``Authorization: Bearer <token>`` works for scripts.

Unless the server listens on every interface (where the token is what protects it), only an exact
list of Host names is answered: the loopback names and the address the server is bound to. A web
page that rebinds its own DNS name to 127.0.0.1 (``127.0.0.1.nip.io``, ``evil.example``) sends its
own name as the Host, so it cannot read the runs through the browser. Nothing is matched by prefix.
"""

from __future__ import annotations

import ipaddress
import secrets
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any
from urllib.parse import parse_qs

from batchtap.errors import ConfigError

__all__ = ["COOKIE", "TokenGate", "new_token", "is_loopback", "check_token", "allowed_hosts"]

COOKIE = "batchtap_ui_token"
#: The Host names a loopback-bound server answers to, whatever address it is bound to.
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "[::1]"})
# A token travels in a URL's query, a cookie and a header: characters any of them would split,
# quote or re-encode are refused rather than escaped differently in each place.
_TOKEN_FORBIDDEN = frozenset(' "\\,;&#%+=?')

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def new_token() -> str:
    """A fresh random token (32 bytes, URL-safe)."""
    return secrets.token_urlsafe(32)


def is_loopback(host: str) -> bool:
    """Whether a bind address is this machine's loopback: ``localhost`` or a loopback IP literal.

    Example:
        >>> is_loopback("127.0.0.1"), is_loopback("0.0.0.0"), is_loopback("127.0.0.2")
        (True, False, True)
        >>> is_loopback("127.0.0.1.nip.io"), is_loopback("::1")
        (False, True)
    """
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_token(token: str | None) -> str | None:
    """``token`` if it can be used, ``None`` if none was given; raise if it cannot.

    A usable token is non-empty printable ASCII without spaces or any of ``"\\,;&#%+=?`` (it
    travels in the link, a cookie and a header).

    Raises:
        ConfigError: the token is empty or has a character that cannot travel.

    Example:
        >>> check_token("s3cret-token")
        's3cret-token'
        >>> check_token("")
        Traceback (most recent call last):
        ...
        batchtap.errors.ConfigError: the UI token must not be empty; fix: give a token, or none to have one generated
    """
    if token is None:
        return None
    if not isinstance(token, str):
        raise ConfigError(f"the UI token must be a str, got {type(token).__name__}; fix: pass a string")
    if token == "":
        raise ConfigError("the UI token must not be empty; fix: give a token, or none to have one generated")
    bad = sorted({c for c in token if not ("!" <= c <= "~") or c in _TOKEN_FORBIDDEN})
    if bad:
        shown = ", ".join(repr(c) for c in bad[:5])
        raise ConfigError(
            f"the UI token may hold printable ASCII only, without spaces or any of "
            f"{''.join(sorted(_TOKEN_FORBIDDEN)).strip()!r}; got {shown}; fix: use letters, digits, '-', '_', "
            "'.' or '~', or give none to have one generated"
        )
    return token


def allowed_hosts(bind: str) -> frozenset[str] | None:
    """The Host names a server bound to ``bind`` answers: the loopback names and ``bind`` itself;
    ``None`` (any name) for the every-interface addresses, where a token is always required.

    Example:
        >>> sorted(allowed_hosts("127.0.0.1"))
        ['127.0.0.1', '[::1]', 'localhost']
        >>> sorted(allowed_hosts("::1"))
        ['127.0.0.1', '[::1]', 'localhost']
        >>> "192.168.1.5" in allowed_hosts("192.168.1.5"), allowed_hosts("0.0.0.0")
        (True, None)
    """
    if bind in ("0.0.0.0", "::", "[::]", ""):
        return None
    name = bind.lower()
    if ":" in name and not name.startswith("["):
        name = f"[{name}]"
    return LOOPBACK_HOSTS | {name}


class TokenGate:
    """ASGI middleware: refuse (403) any HTTP request whose Host is not in ``hosts`` (``None``:
    any), then (401) any without the token when there is one.

    Args:
        app: the application behind the gate.
        token: the token every request must carry, or ``None``.
        hosts: the exact Host names answered (without port), or ``None`` for any; by default the
            loopback names. ``None`` needs a token: a server anyone can name must not answer everyone.

    Raises:
        ConfigError: a bad token (see :func:`check_token`), or no token and no Host list.
    """

    def __init__(self, app: ASGIApp, token: str | None, hosts: frozenset[str] | None = LOOPBACK_HOSTS) -> None:
        self.app = app
        self.token = check_token(token)
        self.hosts = hosts
        if self.hosts is None and self.token is None:
            raise ConfigError("a UI answering any Host name needs a token; fix: give a token, or a Host list")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if self.hosts is not None and _host_name(headers.get("host", "")) not in self.hosts:
            names = ", ".join(sorted(self.hosts))
            await _refuse(send, 403, f"this server answers only to the Host names {names}")
            return
        if self.token is None:
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
    """The Host header without its port, lower-cased (names are case-insensitive)."""
    host = host.strip().lower()
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
