"""A reward service for the tests (megarl/rewards/remote.py's protocol): POST {"responses", "answers",
"metas"} -> {"rewards"}, reward 1.0 for a response of even length, else 0.0 (a rule the tests recompute
from rollouts.jsonl). ``python tests/reward_test_server.py PORT`` serves until killed; ``serve()``
runs it in a thread. ``REWARD_TEST_FAIL_FIRST=N`` answers the first N requests with HTTP 500."""

from __future__ import annotations

import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def even_length(response: str) -> float:
    return 1.0 if len(response) % 2 == 0 else 0.0


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 (http.server's name)
        server = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        server.requests.append(body)
        if len(server.requests) <= server.fail_first:
            self.send_response(500)
            self.end_headers()
            return
        assert len(body["responses"]) == len(body["answers"]) == len(body["metas"])
        out = json.dumps({"rewards": [even_length(r) for r in body["responses"]]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args):
        pass


def make_server(port: int = 0, fail_first: int = 0) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer(("127.0.0.1", port), _Handler)
    server.requests, server.fail_first = [], fail_first
    return server


def serve(port: int = 0, fail_first: int = 0) -> ThreadingHTTPServer:
    server = make_server(port, fail_first)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


if __name__ == "__main__":
    make_server(int(sys.argv[1]), int(os.environ.get("REWARD_TEST_FAIL_FIRST", "0"))).serve_forever()
