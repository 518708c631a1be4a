"""Servers that accept a connection and never answer, for the remote-service deadline tests:
``silent`` reads the request and sends nothing; ``drip`` sends a valid-looking HTTP reply one byte
every ``interval_s`` seconds without end (each byte resets a per-read socket timeout, so only a total
deadline ends the wait). ``serve(mode)`` runs one in a thread; ``python tests/silent_servers.py MODE
PORT`` serves until killed. ``connections`` counts what was accepted (a retry is one more)."""

from __future__ import annotations

import socket
import sys
import threading

DRIP = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n" + b" " * 100000


class SilentServer:
    def __init__(self, mode: str, port: int = 0, interval_s: float = 0.25):
        if mode not in ("silent", "drip"):
            raise ValueError(f"mode: silent or drip, got {mode!r}")
        self.mode, self.interval_s = mode, interval_s
        self.sock = socket.create_server(("127.0.0.1", port))
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self.stopped = threading.Event()
        self.held = []

    def serve_forever(self) -> None:
        self.sock.settimeout(0.1)
        while not self.stopped.is_set():
            try:
                conn, _ = self.sock.accept()
            except (socket.timeout, OSError):
                continue
            self.connections += 1
            self.held.append(conn)
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn) -> None:
        conn.settimeout(0.5)
        try:
            conn.recv(1 << 16)  # the request (its headers at least): then nothing more
        except OSError:
            pass
        if self.mode == "drip":
            for byte in DRIP:
                if self.stopped.wait(self.interval_s):
                    return
                try:
                    conn.sendall(bytes([byte]))
                except OSError:  # the client gave up
                    return

    def stop(self) -> None:
        self.stopped.set()
        self.sock.close()
        for conn in self.held:
            conn.close()


def serve(mode: str, interval_s: float = 0.25) -> SilentServer:
    server = SilentServer(mode, interval_s=interval_s)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


if __name__ == "__main__":
    SilentServer(sys.argv[1], int(sys.argv[2])).serve_forever()
