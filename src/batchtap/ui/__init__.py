"""``batchtap ui``: a live browser view of a store's runs (needs ``pip install 'batchtap[ui]'``).

A runs table (status, steps, last and best values, anomalies, one column per config key), a page
per run (one chart per metric with zoom, pan and hover, raw and smoothed lines, events drawn at
their steps, step time split into compute and data wait, the per-rank spread, config, environment
and events as tables) that grows by itself while the run trains, and runs overlaid to compare.
The store is opened read-only. See docs/ui.md.

Example:
    >>> import batchtap as bt
    >>> callable(bt.ui.serve) and callable(bt.ui.start)
    True
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

from batchtap._optional import require
from batchtap.ui.auth import allowed_hosts, check_token, is_loopback, new_token

__all__ = ["serve", "start", "UIServer"]

# uvicorn waits for open responses at shutdown; the live streams end on their own within one poll,
# and this bounds the wait for anything else.
_GRACE_S = 1


class UIServer:
    """A running UI server in a background thread (from :func:`start`): ``url`` to open, ``stop()``.

    Attributes:
        url: the address to open, with ``?token=...`` when a token is required.
        base: the address without the token.
        token: the token, or ``None`` on loopback without one.
    """

    def __init__(self, server: Any, thread: threading.Thread, base: str, token: str | None, store: Any) -> None:
        self._server = server
        self._thread = thread
        self._store = store
        self.base = base
        self.token = token
        self.url = base + (f"/?token={token}" if token else "/")

    def stop(self, timeout: float = 10.0) -> None:
        """Shut the server down and close the store; open pages' streams end at once."""
        self._server.should_exit = True
        self._thread.join(timeout)
        self._store.close()

    def __enter__(self) -> UIServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _build(
    db: str | os.PathLike[str] | None,
    host: str,
    port: int,
    token: str | None,
    schema: str | None,
    log_level: str,
    *,
    in_users_process: bool,
) -> tuple[Any, Any, str | None]:
    require("starlette", extra="ui", purpose="batchtap ui")
    uvicorn = require("uvicorn", extra="ui", purpose="batchtap ui")
    require("bokeh", extra="ui", purpose="batchtap ui (its BokehJS draws the charts)")
    from batchtap._defaults import store_url
    from batchtap.ui.app import make_app
    from batchtap.ui.data import ReadOnlyStore

    token = check_token(token)  # before the store opens: a bad token is the caller's to fix
    if token is None and not is_loopback(host):
        token = new_token()  # any other interface: nobody reads without the printed link
    store = ReadOnlyStore(db if db is not None else store_url(), schema=schema)
    holder: dict[str, Any] = {}
    app = make_app(store, token=token, hosts=allowed_hosts(host), stopping=lambda: bool(holder["server"].should_exit))
    # In the user's process (bt.ui.start) uvicorn must not configure logging: its dictConfig shuts
    # down every handler the process ever made, and some close their stream then (absl's, made when
    # TensorFlow is imported, closes the sys.stderr it was made with once that is no longer
    # sys.stderr: a notebook's or a test runner's). Its loggers still get the level; records go to
    # the user's own handlers. `batchtap ui` is a process of its own: uvicorn's usual log there.
    logging = {"log_config": None} if in_users_process else {}
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=_GRACE_S, lifespan="off", **logging
    )
    server = holder["server"] = uvicorn.Server(config)
    return server, store, token


def _bound(server: Any, host: str) -> str:
    port = server.servers[0].sockets[0].getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"


def start(
    db: str | os.PathLike[str] | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    token: str | None = None,
    schema: str | None = None,
    log_level: str = "warning",
) -> UIServer:
    """Start the UI in a background thread and return once it accepts connections.

    Args:
        db: the store (SQLite path, ``sqlite:///path``, ``postgresql://...``); default
            ``$BATCHTAP_DB``, else ``runs/batchtap.db``.
        host: interface to bind; anything but loopback requires a token.
        port: TCP port; 0 picks a free one (see :attr:`UIServer.url`).
        token: require this token on every request; generated when ``host`` is not loopback.
            Non-empty printable ASCII (see :func:`batchtap.ui.auth.check_token`).
        schema: PostgreSQL schema holding the tables.
        log_level: uvicorn's log level.

    Only the loopback Host names and ``host`` itself are answered, unless ``host`` is every
    interface (``0.0.0.0``, ``::``), where the token guards every request.

    Raises:
        batchtap.errors.ConfigError: an empty token, or one that is not printable ASCII.
        batchtap.store.StoreError: the store cannot be opened read-only.
        ImportError: the ``ui`` extra is missing.
    """
    server, store, token = _build(db, host, port, token, schema, log_level, in_users_process=True)
    thread = threading.Thread(target=server.run, name="batchtap-ui", daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            store.close()
            raise OSError(f"batchtap ui could not start on {host}:{port} (see the log above)")
        time.sleep(0.01)
    return UIServer(server, thread, _bound(server, host), token, store)


def serve(
    db: str | os.PathLike[str] | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 8080,
    token: str | None = None,
    schema: str | None = None,
    log_level: str = "warning",
) -> None:
    """Serve the UI until interrupted (Ctrl-C), printing the address to open.

    Args: as :func:`start` (``port`` defaults to 8080).
    """
    server, store, token = _build(db, host, port, token, schema, log_level, in_users_process=False)
    thread = threading.Thread(target=_announce, args=(server, host, token, store.where), daemon=True)
    thread.start()
    try:
        server.run()
    finally:
        store.close()


def _announce(server: Any, host: str, token: str | None, where: str) -> None:
    while not server.started:
        if server.should_exit:
            return
        time.sleep(0.02)
    base = _bound(server, host)
    link = base + (f"/?token={token}" if token else "/")
    print(f"batchtap ui: {where} (read-only) at {link}", flush=True)
    if token:
        print("batchtap ui: the token is required on every request; keep the link to yourself", flush=True)
    print("batchtap ui: Ctrl-C to stop", file=sys.stderr, flush=True)
