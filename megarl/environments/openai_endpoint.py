"""An OpenAI-compatible endpoint in front of a generator replica, for agent programs megarl does not
write (``rollout.agent``, agent_env.py): ``/v1/chat/completions`` (with tools), ``/v1/completions``
and ``/v1/models``, on 127.0.0.1 only.

Each episode is a *session*, named by the API key its agent is given (``Authorization: Bearer
<key>``, what every OpenAI client sends). A call is one turn of the episode: its new ids are
appended to the trajectory, the generator samples the turn from the whole context, and the answer
goes back as an OpenAI response with the sampled text, parsed ``<tool_call>`` blocks as
``tool_calls``, log-probs if asked, and megarl's record of the call (``megarl.token_ids``,
``megarl.policy_versions``). Nothing the agent sends back is re-encoded:

- chat: a call's messages must be the session's history (every message sent and every answer
  given, compared after normalising what clients add: ``refusal: null``, argument JSON spacing)
  followed by new ones; only the new ones are rendered (chat_render.py);
- completions: a text prompt must start with the decoded context so far, an id prompt with its
  ids; only the rest is encoded.

A call that does not continue its session (an agent that edits or drops earlier history) ends the
trajectory there, finish ``history_edited`` (counted in ``episode_history_edited_frac``), and is
answered HTTP 409; so is a call after the episode ended (turn limit, context limit, timeout,
abort). Sampling settings are the rollout's: the behaviour policy must be the one the trainer
corrects for, so a request's ``temperature`` / ``top_p`` other than the rollout's, ``n`` > 1,
``stream``, ``stop``, penalties or a forced ``tool_choice`` are refused with HTTP 400 naming the
field; ``max_tokens`` / ``max_completion_tokens`` lower the turn's limit.
"""

from __future__ import annotations

import json
import queue
import secrets
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Dict, List, Optional, Tuple

from megarl.environments.chat_render import ChatRenderer
from megarl.environments.tool import parse_tool_calls


class RequestError(Exception):
    """An HTTP error answer: ``status``, OpenAI's error ``type`` and the field at fault."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.param, self.kind = status, param, kind


# fields a request may carry and megarl reads; others are refused by name
_CHAT_FIELDS = {
    "model", "messages", "tools", "tool_choice", "parallel_tool_calls", "max_tokens", "max_completion_tokens",
    "temperature", "top_p", "n", "stream", "logprobs", "top_logprobs", "user", "seed", "stop",
    "presence_penalty", "frequency_penalty",
}  # fmt: skip
_COMPLETION_FIELDS = {
    "model", "prompt", "max_tokens", "temperature", "top_p", "n", "stream", "logprobs", "user", "seed", "stop",
    "presence_penalty", "frequency_penalty", "echo",
}  # fmt: skip


@dataclass(frozen=True)
class Sampling:
    """The rollout's sampling settings a request may restate but not change."""

    temperature: float
    top_p: float


@dataclass
class Call:
    """One parsed request, as the session's environment thread sees it."""

    kind: str  # "chat" | "completion"
    new_messages: List[dict] = field(default_factory=list)  # chat: the messages after the history
    messages: List[dict] = field(default_factory=list)  # chat: the whole list, normalised
    tools: Optional[list] = None
    prompt: object = None  # completion: text or ids
    max_tokens: Optional[int] = None
    logprobs: bool = False


@dataclass
class Answer:
    """A sampled turn, for the waiting HTTP call."""

    token_ids: List[int]
    text: str  # decoded without special tokens
    logprobs: List[float]
    versions: List[int]
    finish_reason: str  # "stop" | "length"
    prompt_tokens: int  # the context it was sampled from
    index: int  # the session's call number (tool call ids)


def _check_sampling(body: dict, sampling: Sampling, allowed: set) -> None:
    for name in body:
        if name not in allowed:
            raise RequestError(400, f"megarl's endpoint does not implement the field {name!r}", name)
    for name, want in (("temperature", sampling.temperature), ("top_p", sampling.top_p)):
        got = body.get(name)
        if got is not None and abs(float(got) - want) > 1e-9:
            raise RequestError(
                400,
                f"{name}={got}: the rollout samples at {name}={want} (the behaviour policy the trainer corrects "
                f"for); leave {name} out or set it to {want}",
                name,
            )
    if body.get("n", 1) != 1:
        raise RequestError(400, "n: megarl samples one completion per call (the rollout's samples are episodes)", "n")
    if body.get("stream"):
        raise RequestError(400, "stream: streaming answers are not implemented", "stream")
    if body.get("stop"):
        raise RequestError(400, "stop: stop sequences are not implemented (the rollout's stop tokens apply)", "stop")
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name):
            raise RequestError(400, f"{name}: penalties would change the behaviour policy; not implemented", name)


def _max_tokens(body: dict, *names: str) -> Optional[int]:
    for name in names:
        value = body.get(name)
        if value is not None:
            if not isinstance(value, int) or value < 1:
                raise RequestError(400, f"{name}: must be a positive integer, got {value!r}", name)
            return value
    return None


def normalise_message(m) -> dict:
    """A chat message as megarl compares it: role, content ('' for none), name, tool_call_id, and
    tool calls as (name, arguments parsed from their JSON)."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise RequestError(400, f"messages: each message needs a role, got {m!r}"[:300], "messages")
    content = m.get("content")
    if isinstance(content, list):  # content parts: text only
        if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
            raise RequestError(400, "messages: only text content parts are supported", "messages")
        content = "".join(p.get("text", "") for p in content)
    out = {"role": m["role"], "content": content or ""}
    for key in ("name", "tool_call_id"):
        if m.get(key) is not None:
            out[key] = m[key]
    calls = []
    for c in m.get("tool_calls") or []:
        fn = c.get("function") or {}
        arguments = fn.get("arguments")
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except json.JSONDecodeError:
            pass
        calls.append({"id": c.get("id"), "name": fn.get("name"), "arguments": arguments})
    if calls:
        out["tool_calls"] = calls
    return out


def template_message(m: dict) -> dict:
    """A normalised message as chat templates read it (OpenAI's tool_calls shape)."""
    out = {k: v for k, v in m.items() if k != "tool_calls"}
    if m.get("tool_calls"):
        out["tool_calls"] = [
            {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in m["tool_calls"]
        ]
    return out


class Session:
    """One episode's calls: the HTTP thread puts parsed calls in ``events`` and waits for the
    answer; the episode's environment thread takes them and answers with the sampled turn."""

    def __init__(self, key: str, renderer: ChatRenderer, sampling: Sampling):
        self.key, self.renderer, self.sampling = key, renderer, sampling
        self.events: "queue.Queue[Tuple[str, object]]" = queue.Queue()
        self.lock = threading.Condition()
        self.history: List[dict] = []  # chat: normalised messages sent and answers given
        self.kind: Optional[str] = None
        self.pending = False  # a call waits for its answer
        self.answer: Optional[Answer] = None
        self.closed: Optional[str] = None  # why no more calls are answered
        self.calls = 0

    # -- the HTTP thread -------------------------------------------------------------------------

    def chat(self, body: dict) -> Answer:
        _check_sampling(body, self.sampling, _CHAT_FIELDS)
        if body.get("tool_choice") not in (None, "auto"):
            raise RequestError(400, "tool_choice: only 'auto' is implemented", "tool_choice")
        if body.get("top_logprobs"):
            raise RequestError(400, "top_logprobs: not implemented (logprobs: true gives each token's)", "top_logprobs")
        raw = body.get("messages")
        if not isinstance(raw, list) or not raw:
            raise RequestError(400, "messages: a non-empty list is required", "messages")
        messages = [normalise_message(m) for m in raw]
        tools = body.get("tools") or None
        call = Call(
            "chat",
            messages=messages,
            tools=tools,
            max_tokens=_max_tokens(body, "max_completion_tokens", "max_tokens"),
            logprobs=bool(body.get("logprobs")),
        )
        return self._call(call)

    def completion(self, body: dict) -> Answer:
        _check_sampling(body, self.sampling, _COMPLETION_FIELDS)
        prompt = body.get("prompt")
        ok_ids = isinstance(prompt, list) and prompt and all(isinstance(i, int) for i in prompt)
        if not (isinstance(prompt, str) and prompt) and not ok_ids:
            raise RequestError(400, "prompt: one string or one list of token ids is required", "prompt")
        if body.get("echo"):
            raise RequestError(400, "echo: not implemented", "echo")
        call = Call("completion", prompt=prompt, max_tokens=_max_tokens(body, "max_tokens"))
        call.logprobs = body.get("logprobs") is not None
        return self._call(call)

    def _call(self, call: Call) -> Answer:
        with self.lock:
            if self.closed:
                raise RequestError(409, f"this session's episode has ended ({self.closed})", kind="session_ended")
            if self.pending:
                raise RequestError(409, "a call of this session is still being answered: one at a time")
            if self.kind is not None and call.kind != self.kind:
                raise RequestError(400, f"this session uses /v1/{self.kind}s; one episode, one kind of call")
            self.kind = call.kind
            if call.kind == "chat":
                if self.history and not (
                    len(call.messages) > len(self.history) and call.messages[: len(self.history)] == self.history
                ):
                    self.events.put(("edited", None))
                    self.closed = "history_edited"
                    raise RequestError(
                        409,
                        "the messages do not continue this session's history (an earlier message was edited or "
                        "dropped): megarl ends the trajectory here rather than re-encode it",
                        "messages",
                        kind="history_edited",
                    )
                call.new_messages = call.messages[len(self.history) :]
                self.history = list(call.messages)
            self.pending, self.answer = True, None
            self.calls += 1
            self.events.put(("call", call))
            while self.answer is None and not self.closed:
                self.lock.wait()
            self.pending = False
            if self.answer is None:
                raise RequestError(409, f"this session's episode has ended ({self.closed})", kind="session_ended")
            answer = self.answer
            if call.kind == "chat":
                self.history.append(normalise_message(assistant_message(answer)))
            return answer

    # -- the environment thread ------------------------------------------------------------------

    def give(self, answer: Answer) -> None:
        with self.lock:
            self.answer = answer
            self.lock.notify_all()

    def close(self, why: str) -> None:
        with self.lock:
            if not self.closed:
                self.closed = why
            self.lock.notify_all()
        self.events.put(("closed", why))


def assistant_message(answer: Answer) -> dict:
    """The OpenAI assistant message of a sampled turn: text outside ``<tool_call>`` blocks as
    content, the blocks that parse as ``tool_calls`` (ids derived from the turn's ids: a client's
    echo of the message compares equal)."""
    calls = [c for c in parse_tool_calls(answer.text) if c.error is None]
    content = answer.text
    for c in sorted(parse_tool_calls(answer.text), key=lambda c: -c.span[0]):
        if c.error is None:
            content = content[: c.span[0]] + content[c.span[1] :]
    message = {"role": "assistant", "content": content.strip() if calls else answer.text}
    if calls:
        message["tool_calls"] = [
            {
                "id": f"call_{answer.index}_{i}",
                "type": "function",
                "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
            }
            for i, c in enumerate(calls)
        ]
        message["content"] = message["content"] or None
    return message


class OpenAIEndpoint:
    """The HTTP server of one generator replica: ``open_session()`` -> a session and its key;
    ``base_url`` is what agents get (``http://127.0.0.1:PORT/v1``)."""

    def __init__(self, renderer: ChatRenderer, sampling: Sampling, model_name: str = "megarl-policy"):
        self.renderer, self.sampling, self.model_name = renderer, sampling, model_name
        self.sessions: Dict[str, Session] = {}
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.server.daemon_threads = True
        self.server.endpoint = self
        self.thread = threading.Thread(target=self.server.serve_forever, name="megarl-openai", daemon=True)
        self.thread.start()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def open_session(self) -> Session:
        key = "megarl-" + secrets.token_hex(12)
        session = Session(key, self.renderer, self.sampling)
        with self.lock:
            self.sessions[key] = session
        return session

    def end_session(self, session: Session, why: str) -> None:
        session.close(why)
        with self.lock:
            self.sessions.pop(session.key, None)

    def session_of(self, authorization: Optional[str]) -> Session:
        key = (authorization or "").removeprefix("Bearer ").strip()
        with self.lock:
            session = self.sessions.get(key)
        if session is None:
            raise RequestError(401, "unknown API key: each episode's agent gets its own (AgentTask.api_key)",
                               kind="authentication_error")  # fmt: skip
        return session

    def close(self) -> None:
        with self.lock:
            sessions, self.sessions = list(self.sessions.values()), {}
        for s in sessions:
            s.close("the generator stopped")
        self.server.shutdown()
        self.server.server_close()


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        endpoint: OpenAIEndpoint = self.server.endpoint
        if self.path.rstrip("/") == "/v1/models":
            self._send(200, {"object": "list", "data": [{"id": endpoint.model_name, "object": "model",
                                                        "created": 0, "owned_by": "megarl"}]})  # fmt: skip
        else:
            self._send(404, _error(RequestError(404, f"no route {self.path}")))

    def do_POST(self):  # noqa: N802
        endpoint: OpenAIEndpoint = self.server.endpoint
        try:
            route = self.path.rstrip("/")
            if route not in ("/v1/chat/completions", "/v1/completions"):
                raise RequestError(404, f"no route {self.path}")
            session = endpoint.session_of(self.headers.get("Authorization"))
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            except json.JSONDecodeError as exc:
                raise RequestError(400, f"the body is not JSON: {exc.msg}") from None
            if not isinstance(body, dict):
                raise RequestError(400, "the body must be a JSON object")
            if route == "/v1/chat/completions":
                answer = session.chat(body)
                out = _chat_response(answer, body, endpoint.model_name, session.renderer)
            else:
                answer = session.completion(body)
                out = _completion_response(answer, body, endpoint.model_name)
            self._send(200, out)
        except RequestError as exc:
            self._send(exc.status, _error(exc))

    def _send(self, status: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def _error(exc: RequestError) -> dict:
    return {"error": {"message": str(exc), "type": exc.kind, "param": exc.param, "code": None}}


def _usage(answer: Answer) -> dict:
    n = len(answer.token_ids)
    return {"prompt_tokens": answer.prompt_tokens, "completion_tokens": n, "total_tokens": answer.prompt_tokens + n}


def _record(answer: Answer) -> dict:
    return {"token_ids": answer.token_ids, "policy_versions": answer.versions}


def _chat_response(answer: Answer, body: dict, model: str, renderer: ChatRenderer) -> dict:
    message = assistant_message(answer)
    finish = "tool_calls" if message.get("tool_calls") else answer.finish_reason
    choice = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
    if body.get("logprobs"):
        tokens = [renderer.tokenizer.decode([i], skip_special_tokens=False) for i in answer.token_ids]
        choice["logprobs"] = {
            "content": [
                {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                for t, lp in zip(tokens, answer.logprobs)
            ]
        }
    return {
        "id": f"chatcmpl-{secrets.token_hex(8)}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body.get("model") or model,
        "choices": [choice],
        "usage": _usage(answer),
        "megarl": _record(answer),
    }


def _completion_response(answer: Answer, body: dict, model: str) -> dict:
    choice = {"index": 0, "text": answer.text, "finish_reason": answer.finish_reason, "logprobs": None}
    if body.get("logprobs") is not None:
        choice["logprobs"] = {"token_logprobs": answer.logprobs, "tokens": None, "top_logprobs": None}
    return {
        "id": f"cmpl-{secrets.token_hex(8)}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": body.get("model") or model,
        "choices": [choice],
        "usage": _usage(answer),
        "megarl": _record(answer),
    }
