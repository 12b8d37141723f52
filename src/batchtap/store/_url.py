"""Store URLs: which backend a URL names, and how to show a DSN without its password."""

from __future__ import annotations

import dataclasses
import os
import re
import urllib.parse
from typing import Literal

from batchtap.store._errors import StoreError

__all__ = ["StoreURL", "parse_url", "redact_dsn"]

_PG_SCHEMES = ("postgresql://", "postgres://")
_SQLITE_SCHEME = "sqlite:///"
# key=value conninfo: password='quoted \' value' or password=bare
_KV_PASSWORD = re.compile(r"(\bpassword\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)")


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

    Example:
        >>> redact_dsn("postgresql://bob:s3cret@db:5432/x?sslmode=disable")
        'postgresql://bob:***@db:5432/x?sslmode=disable'
        >>> redact_dsn("host=db password='a b' user=bob")
        'host=db password=*** user=bob'
    """
    if "://" not in dsn:
        return _KV_PASSWORD.sub(r"\1***", dsn)
    try:
        parts = urllib.parse.urlsplit(dsn)
    except ValueError:
        return "<unparsable DSN>"
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, hostport = netloc.rpartition("@")
        if ":" in userinfo:
            userinfo = userinfo.split(":", 1)[0] + ":***"
        netloc = f"{userinfo}@{hostport}"
    query = parts.query
    if query:
        pairs = urllib.parse.parse_qsl(query, keep_blank_values=True)
        if any(k == "password" for k, _ in pairs):
            query = "&".join(
                f"{k}=***" if k == "password" else f"{k}={urllib.parse.quote(v, safe='')}" for k, v in pairs
            )
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
