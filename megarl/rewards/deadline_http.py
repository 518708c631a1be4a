"""An HTTP POST with a total deadline, for the reward service and the judge.

urllib's ``timeout`` bounds each socket operation, not the request: a server that accepts and then
sends one byte a second resets it with every byte and holds the caller for as long as it likes. Here
a timer shuts the request's sockets down when ``timeout_s`` has passed since the request began,
which ends whatever read or write is blocked, and the request fails with :class:`DeadlineExceeded`
(an OSError, as urllib's own timeouts are). urllib still opens the request, so proxies, redirects
and HTTP errors behave as with ``urllib.request.urlopen``.
"""

from __future__ import annotations

import http.client
import socket
import threading
import urllib.request


class DeadlineExceeded(TimeoutError):
    pass


class _Sockets:
    """The sockets a request opened; ``expire`` shuts each down, and any opened later at once."""

    def __init__(self):
        self.lock = threading.Lock()
        self.open, self.expired = [], False

    def add(self, sock) -> None:
        with self.lock:
            self.open.append(sock)
            if self.expired:
                _shut(sock)

    def expire(self) -> None:
        with self.lock:
            self.expired = True
            for sock in self.open:
                _shut(sock)


def _shut(sock) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # already closed
        pass


def _watched(sockets: _Sockets):
    class Handler(urllib.request.HTTPHandler):
        def http_open(self, req):
            return self.do_open(_connection_class(http.client.HTTPConnection, sockets), req)

    class SecureHandler(urllib.request.HTTPSHandler):
        def https_open(self, req):
            return self.do_open(_connection_class(http.client.HTTPSConnection, sockets), req,
                                context=self._context)  # fmt: skip

    return urllib.request.build_opener(Handler, SecureHandler)


def _connection_class(base, sockets: _Sockets):
    class Connection(base):
        def connect(self):
            super().connect()
            sockets.add(self.sock)

    return Connection


def post(url: str, body: bytes, timeout_s: float, headers: dict) -> bytes:
    """The reply's body, read in full within ``timeout_s`` of the call, else DeadlineExceeded."""
    sockets = _Sockets()
    timer = threading.Timer(timeout_s, sockets.expire)
    timer.daemon = True
    timer.start()
    try:
        request = urllib.request.Request(url, data=body, headers=headers)
        with _watched(sockets).open(request, timeout=timeout_s) as response:
            data = response.read()
    except Exception as exc:
        # urllib's own per-operation timeout (the same timeout_s) may fire first on a silent server
        if sockets.expired or isinstance(exc, TimeoutError) or isinstance(getattr(exc, "reason", None), TimeoutError):
            raise DeadlineExceeded(f"no complete reply within {timeout_s:g} s") from exc
        raise
    finally:
        timer.cancel()
    if sockets.expired:  # the last bytes raced the timer: a reply cut short reads as complete
        raise DeadlineExceeded(f"no complete reply within {timeout_s:g} s")
    return data
