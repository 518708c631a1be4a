"""The SGLang backend's watchdog: a launched server that dies ends the rank, naming it;
a server the job itself stops at the end does not.

The server here is a stand-in with SglangServer's ``exited(wait_s)`` / ``stop()``:
its ``exited`` waits, as the real one does on the process, until ``stop()`` ends it.
"""

from __future__ import annotations

import threading

from megarl.generator.sglang.http_backend import SglangBackend


class _Server:
    log_path = "/runs/x/sglang/replica0.log"

    def __init__(self):
        self.code = None
        self.ended = threading.Event()
        self.watched = threading.Event()  # the watchdog is inside exited(), waiting on the process

    def exited(self, wait_s: float = 0.0):
        if wait_s:
            self.watched.set()
            self.ended.wait(30)  # until it ends: the health check, which nobody answers here, is never reached
        return self.code

    def die(self, code: int) -> None:
        self.code = code
        self.ended.set()

    def stop(self) -> None:
        self.die(-15)  # SIGTERM, as SglangServer.stop sends


def _backend(server, failures):
    # a URL nobody answers: the watchdog only gets as far as the process check when it is alive
    return SglangBackend(
        "http://127.0.0.1:9", server=server, on_failure=failures.append, health_interval_s=0.01, health_timeout_s=0.01
    )


def test_a_server_stopped_by_close_is_not_reported_as_a_failure():
    server, failures = _Server(), []
    backend = _backend(server, failures)
    assert server.watched.wait(10)  # the watchdog waits on the process when close() stops it
    backend.close()
    backend.watchdog.join(10)
    assert not backend.watchdog.is_alive()
    assert failures == [] and backend.failure is None


def test_a_server_that_dies_ends_the_rank_naming_it_and_its_log():
    server, failures = _Server(), []
    backend = _backend(server, failures)
    assert server.watched.wait(10)
    server.die(-9)
    backend.watchdog.join(10)
    assert failures == [
        "SGLang server of generator replica 0 (http://127.0.0.1:9) exited with code -9; "
        "its log: /runs/x/sglang/replica0.log"
    ]
    backend.close()
