"""Store URLs: which backend a URL names, and how to show a DSN without its password."""

from __future__ import annotations

import dataclasses
import os
import re
import urllib.parse
from typing import Literal

from batchtap.store.errors import StoreError

__all__ = ["StoreURL", "parse_url", "redact_dsn", "redact_message", "redact_text", "resolvable_dsn"]

_PG_SCHEMES = ("postgresql://", "postgres://")
_SQLITE_SCHEME = "sqlite:///"
# key=value conninfo: password='quoted \' value' or password=bare
_KV_PASSWORD = re.compile(r"(\bpassword\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)", re.IGNORECASE)


@dataclasses.dataclass(frozen=True, slots=True)
class StoreURL:
    """A parsed store location.

    Attributes:
        kind: ``"sqlite"`` or ``"postgresql"``.
        target: the SQLite file path, or the PostgreSQL DSN exactly as given.
    """

    kind: Literal["sqlite", "postgresql"]
    target: str

    def display(self) -> str:
        """The location as safe to print: a PostgreSQL DSN has its password replaced by ``***``."""
        return redact_dsn(self.target) if self.kind == "postgresql" else self.target


def parse_url(url: str | os.PathLike[str]) -> StoreURL:
    """Tell which backend a store URL names.

    A plain path or ``sqlite:///path`` (SQLAlchemy's convention: ``sqlite:///rel/path``,
    ``sqlite:////abs/path``) is SQLite; ``postgresql://...`` (or ``postgres://``) is PostgreSQL.

    Args:
        url: the URL or path.

    Raises:
        StoreError: for any other ``scheme://``.

    Example:
        >>> parse_url("sqlite:///runs/batchtap.db")
        StoreURL(kind='sqlite', target='runs/batchtap.db')
        >>> parse_url("postgresql://u@db/x").kind
        'postgresql'
    """
    text = os.fspath(url)
    if text.startswith(_PG_SCHEMES):
        return StoreURL("postgresql", text)
    if text.startswith(_SQLITE_SCHEME):
        return StoreURL("sqlite", text[len(_SQLITE_SCHEME) :])
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", text):
        raise StoreError(
            f"unsupported store URL {redact_dsn(text)!r}: expected a file path, 'sqlite:///path' "
            "or 'postgresql://user@host/db'"
        )
    return StoreURL("sqlite", text)


def redact_dsn(dsn: str) -> str:
    """A PostgreSQL DSN (URL or ``key=value`` form) with any password replaced by ``***``.

    The text is redacted by pattern (URL user info up to the *last* ``@``, so a password holding
    ``/``, ``#``, ``?`` or ``@`` is covered whole; ``password=`` in a query or a ``key=value``
    string), and then the password as libpq itself reads it (psycopg's conninfo parser) is
    removed wherever it still appears, raw or percent-encoded. Everything else is kept as given
    (``postgresql:///db?host=/socket`` keeps its ``//``).

    Example:
        >>> redact_dsn("postgresql://bob:s3cret@db:5432/x?sslmode=disable")
        'postgresql://bob:***@db:5432/x?sslmode=disable'
        >>> redact_dsn("host=db password='a b' user=bob")
        'host=db password=*** user=bob'
        >>> redact_dsn("postgresql://bob:pa/ss#w?rd@db/x")
        'postgresql://bob:***@db/x'
        >>> redact_dsn("postgresql:///x?host=/tmp&password=p%26w")
        'postgresql:///x?host=/tmp&password=***'
    """
    out = dsn
    if dsn.startswith(_PG_SCHEMES):
        # a whole DSN: its user info runs to the last '@', white space and quotes included
        scheme, _, rest = dsn.partition("://")
        userinfo, at, hostpart = rest.rpartition("@")
        if at and ":" in userinfo and "/" not in userinfo.split(":", 1)[0]:
            out = f"{scheme}://{userinfo.split(':', 1)[0]}:***@{hostpart}"
    out = redact_text(out)
    for secret in _libpq_passwords(dsn):
        out = _scrub_value(out, secret)
    return out


def resolvable_dsn(dsn: str) -> str:
    """A PostgreSQL URL whose user info is percent-encoded where libpq would misread it.

    libpq ends the user info at the *first* ``@``: a password holding an unencoded ``@`` (or ``/``,
    ``?``, ``#``) would put a piece of it into the host name, which is then sent to the name resolver
    (a DNS query off the machine) before any error. The user info here runs to the last ``@`` of the
    part before the query, and its special characters are encoded; ``%`` is left alone (already encoded text stays
    as it is). Anything but a ``postgresql://`` URL is returned unchanged.

    Example:
        >>> resolvable_dsn("postgresql://bob:s@cr/et@db:5432/x?sslmode=disable")
        'postgresql://bob:s%40cr%2Fet@db:5432/x?sslmode=disable'
        >>> resolvable_dsn("postgresql://bob:p%40ss@db/x"), resolvable_dsn("host=db password=a@b")
        ('postgresql://bob:p%40ss@db/x', 'host=db password=a@b')
    """
    if not dsn.startswith(_PG_SCHEMES):
        return dsn
    scheme, _, rest = dsn.partition("://")
    # the user info runs to the last '@' before the query (a query value may hold an '@' of its own)
    query_at = min([i for i in (rest.find("?"), rest.find("#")) if i >= 0] or [len(rest)])
    userinfo, at, hostpart = rest[:query_at].rpartition("@")
    if not at:
        return dsn
    encoded = re.sub(r"[@/?#\[\] ]", lambda m: urllib.parse.quote(m.group(0), safe=""), userinfo)
    return f"{scheme}://{encoded}@{hostpart}{rest[query_at:]}"


# scheme://user:password@  — the user info runs to the last '@' before white space or a quote
_URL_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)(?P<user>[^:@/\s'\"]*):(?P<pw>[^\s'\"]*)@")
_QUERY_PASSWORD = re.compile(r"([?&](?:password|passwd|pwd|token|secret|api_?key)=)[^&#\s'\"]*", re.IGNORECASE)


# an http(s) URL; a webhook's (Slack, Discord, Mattermost, Teams, Zapier, ...) keeps its token in the path
_HTTP_URL = re.compile(r"\b(?P<head>https?://[^/\s'\"?#]+)(?P<tail>[/?#][^\s'\"]*)", re.IGNORECASE)
_WEBHOOK_PATH = re.compile(r"/(api/)?(web)?hooks?[/b]|/services/|/triggers/|/workflows/", re.IGNORECASE)


def _redact_webhook(m: re.Match[str]) -> str:
    head, tail = m["head"], m["tail"]
    host = head.rsplit("@", 1)[-1].lower()
    if "hook" in host or _WEBHOOK_PATH.search(tail):
        return f"{head}/***"
    return m.group(0)


def redact_text(text: str) -> str:
    """``text`` with URL passwords, ``password=`` query values, ``key=value`` passwords and the
    token path of webhook URLs replaced by ``***`` (for argv, config values, messages).

    Example:
        >>> redact_text("--db postgresql://u:p@h/d --x 1")
        '--db postgresql://u:***@h/d --x 1'
        >>> redact_text("--alerts https://hooks.slack.com/services/T0/B0/XXXX")
        '--alerts https://hooks.slack.com/***'
        >>> redact_text("https://discord.com/api/webhooks/123/tok https://example.com/docs/page")
        'https://discord.com/*** https://example.com/docs/page'
    """
    if "://" in text:
        text = _URL_USERINFO.sub(lambda m: f"{m['scheme']}{m['user']}:***@", text)
        text = _QUERY_PASSWORD.sub(r"\1***", text)
        text = _HTTP_URL.sub(_redact_webhook, text)
    if "password" in text.lower():
        text = _KV_PASSWORD.sub(r"\1***", text)
    return text


def redact_message(message: str, dsn: str) -> str:
    """A driver's error message about ``dsn`` without any piece of its password.

    libpq echoes what it took for the host, and a DSN with an unencoded ``@`` in its password
    puts part of the password there; every ``@``-separated piece of the password is removed.

    Example:
        >>> redact_message("failed to resolve host 'cret@db'", "postgresql://bob:s@cret@db/x")
        "failed to resolve host '***@db'"
    """
    secrets = list(_libpq_passwords(dsn))
    if dsn.startswith(_PG_SCHEMES):
        userinfo = dsn.partition("://")[2].rpartition("@")[0]
        if ":" in userinfo:
            secrets.append(userinfo.split(":", 1)[1])
    out = redact_text(message)
    for secret in secrets:
        for piece in {secret, *secret.split("@")}:
            if len(piece) >= 3:
                out = _scrub_value(out, piece)
    return out


def _libpq_passwords(dsn: str) -> list[str]:
    """The password of ``dsn`` as libpq parses it (none when psycopg is missing or the DSN does
    not parse; the pattern redaction covers those)."""
    try:
        from psycopg.conninfo import conninfo_to_dict
    except ImportError:
        return []
    try:
        found = conninfo_to_dict(dsn).get("password")
    except Exception:  # noqa: BLE001 - malformed DSN: nothing more to learn from the parser
        return []
    return [str(found)] if found else []


def _scrub_value(text: str, secret: str) -> str:
    for form in {
        secret,
        urllib.parse.quote(secret, safe=""),
        urllib.parse.quote_plus(secret),
        urllib.parse.quote(secret),
    }:
        if form and form != "***":
            text = text.replace(form, "***")
    return text
