"""A loopback TCP proxy that can turn into a black hole: sockets stay open, nothing is forwarded,
no RST, no FIN — what a dead NAT entry, a paused VM or a failover looks like to a client."""

from __future__ import annotations

import socket
import threading


class BlackHoleProxy:
    """Forward 127.0.0.1:``port`` to ``target``; :meth:`black_hole` stops forwarding in both
    directions on every connection, old and new, while keeping every socket open;
    :meth:`restore` forwards again (new connections; a blackholed one stays dead, as after a
    real failover)."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.port = self._listener.getsockname()[1]
        self._holed = threading.Event()
        self._lock = threading.Lock()
        self._held: list[socket.socket] = []  # sockets kept open (never closed) while holed
        self._closed = False
        #: bytes swallowed while holed (the client did send something and got no answer)
        self.swallowed = 0
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def holed(self) -> bool:
        return self._holed.is_set()

    def black_hole(self) -> None:
        self._holed.set()

    def restore(self) -> None:
        self._holed.clear()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self._held.append(client)
            if self._holed.is_set():
                # accepted by the kernel, never answered
                threading.Thread(target=self._swallow, args=(client,), daemon=True).start()
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._held.append(upstream)
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client), daemon=True).start()

    def _swallow(self, sock: socket.socket) -> None:
        try:
            while data := sock.recv(65536):
                self.swallowed += len(data)
        except OSError:
            pass

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                if self._holed.is_set():
                    self.swallowed += len(data)
                    # from now on this connection is dead air: swallow, never answer, never close
                    self._swallow(src)
                    return
                dst.sendall(data)
        except OSError:
            pass

    def close(self) -> None:
        """Close everything (sockets blocked on the hole then see EOF and wake up)."""
        self._closed = True
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            held, self._held = self._held, []
        for s in held:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
