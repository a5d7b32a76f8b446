"""A TCP proxy on 127.0.0.1 in front of the local S3 server that fails the way a network or an overloaded server
does, switched at any time, open connections included:

- ``pass_through()``: forward both ways.
- ``stall()``: accept connections and read every request, never answer (nothing is forwarded either way).
- ``stall_upload(after_bytes)``: forward ``after_bytes`` more bytes towards the server, then stop reading from
  clients (their sends block once the socket buffers are full); answers still come back.
- ``drop()``: close every new connection at once, and an open one as soon as it carries data.
- ``flaky(every)``: close every ``every``-th new connection at once, forward the others.

A connection that lost data to a fault is closed when it is next used after the fault ends (its HTTP stream is
broken); the client sees a closed connection, as after a real outage.
"""

from __future__ import annotations

import socket
import threading

CHUNK = 64 * 1024


class FaultProxy:
    def __init__(self, upstream_port: int):
        self._upstream = ("127.0.0.1", upstream_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        self._changed = threading.Condition()
        self._mode, self._budget, self._every = "pass", 0, 0
        self.accepted = self.dropped = 0  # connections, for tests that must see a fault happen
        self._sockets: set[socket.socket] = set()
        self._closed = False
        threading.Thread(target=self._accept_loop, name="fault-proxy", daemon=True).start()

    def pass_through(self) -> None:
        self._set("pass")

    def stall(self) -> None:
        self._set("stall")

    def stall_upload(self, after_bytes: int) -> None:
        self._set("stall_upload", budget=after_bytes)

    def drop(self) -> None:
        self._set("drop")

    def flaky(self, every: int) -> None:
        self._set("flaky", every=every)

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify_all()
            sockets = [self._listener, *self._sockets]
        for sock in sockets:
            _shut(sock)

    def _set(self, mode: str, budget: int = 0, every: int = 0) -> None:
        with self._changed:
            self._mode, self._budget, self._every = mode, budget, every
            self._changed.notify_all()

    def _accept_loop(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed
                return
            with self._changed:
                self.accepted += 1
                drop = self._mode == "drop" or (self._mode == "flaky" and self.accepted % self._every == 0)
                self.dropped += drop
            try:
                server = None if drop else socket.create_connection(self._upstream)
            except OSError:  # the S3 server is down: refuse, as it would
                server = None
            if server is None:
                client.close()
                continue
            with self._changed:
                self._sockets |= {client, server}
            broken = threading.Event()  # data was lost: close the pair once it is used again after the fault
            threading.Thread(target=self._pump, args=(client, server, broken, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, broken, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, broken: threading.Event, upload: bool) -> None:
        try:
            while self._wait_until_readable(upload) and (data := src.recv(CHUNK)):
                forward = self._admit(data, upload, broken)
                if forward is None:
                    break
                dst.sendall(forward)
        except OSError:  # the other side or close() shut a socket
            pass
        finally:
            with self._changed:
                self._sockets -= {src, dst}
            for sock in (src, dst):
                _shut(sock)

    def _wait_until_readable(self, upload: bool) -> bool:
        """An exhausted stall_upload stops reading uploads; -> False once the proxy is closed."""
        with self._changed:
            self._changed.wait_for(lambda: self._closed or not (upload and self._mode == "stall_upload"
                                                                 and self._budget == 0))
            return not self._closed

    def _admit(self, data: bytes, upload: bool, broken: threading.Event) -> bytes | None:
        """What of data to forward under the current mode; None: close the connection."""
        with self._changed:
            mode = self._mode
            if mode == "drop" or (mode in ("pass", "flaky") and broken.is_set()):
                return None
            if mode == "stall":
                broken.set()
                return b""
            if mode == "stall_upload" and upload:
                keep = min(len(data), self._budget)
                self._budget -= keep
                if keep < len(data):
                    broken.set()
                return data[:keep]
            return data


def _shut(sock: socket.socket) -> None:
    """Close sock and wake a thread blocked on it."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
