"""A generative judge for the tests: an OpenAI-compatible ``POST /v1/chat/completions`` whose request
is checked against the ``openai`` package's own request parameters and whose reply is built with its
``ChatCompletion`` type, so megarl's judge client speaks what a real server (SGLang, vLLM) speaks.

Its verdict is a rule the tests recompute: the prompt must hold ``<<response>>...<</response>>``
(the tests' template), and the judge says ``Score: 1`` for a response of even length, else
``Score: 0``, after a line of "reasoning" that quotes the format (``Score: 0.5``), so a client that
took the first match would be wrong. ``serve(reply=fn)`` runs it in a thread with ``fn(prompt) ->
str | int`` instead (an int: that HTTP status); ``python tests/judge_test_server.py PORT`` serves
the rule until killed."""

from __future__ import annotations

import json
import re
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Optional, Union

from openai.types.chat import ChatCompletion
from openai.types.chat.completion_create_params import CompletionCreateParamsBase

REQUEST_KEYS = set(CompletionCreateParamsBase.__annotations__)
RESPONSE_RE = re.compile(r"<<response>>(.*?)<</response>>", re.S)


def even_length_verdict(response: str) -> float:
    return 1.0 if len(response) % 2 == 0 else 0.0


def rule(prompt: str) -> Union[str, int]:
    match = RESPONSE_RE.search(prompt)
    if match is None:
        return 400
    return f"The format is 'Score: 0.5' for half credit.\nScore: {even_length_verdict(match.group(1)):g}"


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 (http.server's name)
        server = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        server.requests.append(body)
        if self.path != "/v1/chat/completions" or not set(body) <= REQUEST_KEYS:
            return self._send(404 if self.path != "/v1/chat/completions" else 400, b"{}")
        messages = body["messages"]
        assert isinstance(body["model"], str) and isinstance(messages, list) and messages
        assert all(set(m) == {"role", "content"} and isinstance(m["content"], str) for m in messages)
        reply = server.reply(messages[-1]["content"])
        if isinstance(reply, int):
            return self._send(reply, b'{"error": "scripted"}')
        completion = ChatCompletion(
            id=f"judge-{len(server.requests)}",
            object="chat.completion",
            created=int(time.time()),
            model=body["model"],
            choices=[{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": reply}}],
        )
        self._send(200, completion.model_dump_json().encode())

    def _send(self, status: int, out: bytes):
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args):
        pass


def make_server(port: int = 0, reply: Optional[Callable] = None) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer(("127.0.0.1", port), _Handler)
    server.requests, server.reply = [], reply or rule
    return server


def serve(port: int = 0, reply: Optional[Callable] = None) -> ThreadingHTTPServer:
    server = make_server(port, reply)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


if __name__ == "__main__":
    make_server(int(sys.argv[1])).serve_forever()
