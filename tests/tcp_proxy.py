"""A small TCP proxy on loopback for fault injection: cut every connection, delay traffic, or
black-hole it (a partition: bytes are held, nothing is answered)."""

from __future__ import annotations

import socket
import threading
import time

from .servers import free_port


class TcpProxy:
    def __init__(self, upstream_port: int, upstream_host: str = "127.0.0.1") -> None:
        self.upstream = (upstream_host, upstream_port)
        self.port = free_port()
        self.delay = 0.0
        self.blackhole = False
        self._conns: list[tuple[socket.socket, socket.socket]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._server = socket.socket()
        self._server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._server.bind(("127.0.0.1", self.port))
        self._server.listen(64)
        self._server.settimeout(0.2)
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._server.accept()
            except OSError:
                continue
            try:
                upstream = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns.append((client, upstream))
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            src.settimeout(0.2)
        except OSError:  # cut before this thread started: the recv below fails, both sides are closed
            pass
        while not self._stop.is_set():
            try:
                data = src.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                break
            if not data:
                break
            while self.blackhole and not self._stop.is_set():
                time.sleep(0.01)
            if self.delay:
                time.sleep(self.delay)
            try:
                dst.sendall(data)
            except OSError:
                break
        for s in (src, dst):
            try:
                s.close()
            except OSError:
                pass

    def cut(self) -> int:
        """Close every open connection (both sides); returns how many."""
        with self._lock:
            conns, self._conns = self._conns, []
        for pair in conns:
            for s in pair:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()
        return len(conns)

    def close(self) -> None:
        self._stop.set()
        self.cut()
        self._server.close()
