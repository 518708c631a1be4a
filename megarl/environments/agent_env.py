"""Episodes of an agent program megarl did not write (``rollout.agent: package.module:function``):
the agent talks to the replica's OpenAI-compatible endpoint (openai_endpoint.py) and megarl turns
its calls into one token-exact trajectory.

The agent is called once per episode, in a thread of the generator process, with an
:class:`AgentTask`: ``base_url`` and ``api_key`` are what ``openai.OpenAI(base_url=..., api_key=...)``
takes (the key names the episode), ``messages`` the dataset prompt as chat messages, ``meta`` its
record's fields (``answer`` among them). The agent runs its own loop: calls, tools, whatever it
does between calls. Its return value is not read: the episode is scored by ``reward.*`` on the
whole episode's text like every multi-turn sample.

The episode is the environment of the multi-turn backend: ``reset`` starts the agent and waits
for its first call (the call's rendered context becomes the episode's prompt when it does not
extend the dataset's: an agent with its own system prompt), ``step`` answers the pending call with
the sampled turn and waits for the next one, which inserts only the new messages' ids. The time
between a turn and the agent's next call is environment time, under ``rollout.env_timeout_s``; an
agent that returns ends the episode ("done"), one that raises ends it ("env_error", its exception
in the sample's record), one that edits its history ends it ("history_edited"). When an episode
ends any other way (turn or context limit, timeout, abort) the session closes and the agent's
pending call gets HTTP 409, so the agent's thread ends too.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable, List, Optional

from megarl.environments.chat_render import ChatRenderer
from megarl.environments.episode import StepResult, Trajectory, Turn
from megarl.environments.openai_endpoint import Answer, Call, OpenAIEndpoint, template_message
from megarl.errors import MegarlError


@dataclass(frozen=True)
class AgentTask:
    base_url: str  # http://127.0.0.1:PORT/v1
    api_key: str  # this episode's session
    messages: List[dict]  # the dataset prompt
    meta: dict = field(default_factory=dict)  # the prompt record's fields (answer, ...)
    model: str = "megarl-policy"


class AgentEnvironment:
    """One episode of ``agent`` through ``endpoint``; ``wait_s`` bounds each wait for the agent's
    next call (the multi-turn backend's env_timeout_s ends the episode first; this only frees the
    pool thread)."""

    def __init__(self, endpoint: OpenAIEndpoint, agent: Callable[[AgentTask], object], wait_s: float):
        self.endpoint, self.agent, self.wait_s = endpoint, agent, wait_s
        self.session = endpoint.open_session()
        self.trajectory: Optional[Trajectory] = None
        self.thread: Optional[threading.Thread] = None

    def reset(self, trajectory: Trajectory):
        self.trajectory = trajectory
        messages = trajectory.meta.get("messages")
        if not messages:
            raise MegarlError("rollout.agent: the episode's request carries no chat messages to give the agent")
        task = AgentTask(self.endpoint.base_url, self.session.key, [dict(m) for m in messages],
                         {k: v for k, v in trajectory.meta.items() if k != "messages"},
                         self.endpoint.model_name)  # fmt: skip
        self.thread = threading.Thread(target=self._run_agent, args=(task,), daemon=True,
                                       name=f"megarl-agent-{trajectory.episode_id}")  # fmt: skip
        self.thread.start()
        result = self._next_call(first=True)
        if result.done and not result.finish.startswith("history"):
            raise MegarlError("rollout.agent: the agent returned without making a call")
        return result

    def step(self, turn: Turn) -> StepResult:
        t = self.trajectory
        last = t.segments[-1]
        self.session.give(
            Answer(
                list(turn.token_ids),
                self.endpoint.renderer.tokenizer.decode(list(turn.token_ids), skip_special_tokens=True),
                list(last.logprobs),
                list(last.versions),
                turn.finish_reason,
                prompt_tokens=len(t.context()) - len(turn.token_ids),
                index=self.session.calls,
            )
        )
        return self._next_call(first=False)

    def close(self) -> None:
        finish = self.trajectory.finish if self.trajectory is not None else None
        self.endpoint.end_session(self.session, finish or "ended")

    # -- the agent's calls -----------------------------------------------------------------------

    def _run_agent(self, task: AgentTask) -> None:
        try:
            self.agent(task)
        except BaseException as exc:  # an agent's exception ends its episode as env_error, named
            self.session.events.put(("error", exc))
        else:
            self.session.events.put(("exit", None))

    def _next_call(self, first: bool) -> StepResult:
        import queue

        try:
            kind, value = self.session.events.get(timeout=self.wait_s)
        except queue.Empty:
            return StepResult(done=True, finish="env_timeout")
        if kind == "call":
            return self._ids_of(value, first)
        if kind == "exit":
            return StepResult(done=True)
        if kind == "edited":
            return StepResult(done=True, finish="history_edited")
        if kind == "error":
            raise MegarlError(f"rollout.agent raised {type(value).__name__}: {value}")
        return StepResult(done=True)  # closed: the episode has ended already

    def _ids_of(self, call: Call, first: bool) -> StepResult:
        t, renderer = self.trajectory, self.endpoint.renderer
        if call.kind == "chat":
            if first:
                ids = renderer.render_first([template_message(m) for m in call.messages], call.tools)
            else:
                ids = renderer.render_after(t.segments[-1].token_ids,
                                            [template_message(m) for m in call.new_messages], call.tools)  # fmt: skip
                return StepResult(insert_ids=ids, max_new_tokens=call.max_tokens)
        else:
            ids = self._completion_ids(call.prompt, first)
            if ids is None:
                self.session.close("history_edited")
                return StepResult(done=True, finish="history_edited")
            if not first:
                return StepResult(insert_ids=ids, max_new_tokens=call.max_tokens)
        n = len(t.prompt_ids)
        if ids[:n] == t.prompt_ids:
            return StepResult(insert_ids=ids[n:], max_new_tokens=call.max_tokens)
        t.prompt_ids = list(ids)  # the agent's own context (a system prompt of its own): the episode's prompt
        return StepResult(max_new_tokens=call.max_tokens)

    def _completion_ids(self, prompt, first: bool) -> Optional[List[int]]:
        """A completion prompt's ids: the whole prompt first, then what follows the context so far
        (None: the prompt does not start with it)."""
        renderer = self.endpoint.renderer
        if first:
            return list(prompt) if isinstance(prompt, list) else renderer.encode(prompt)
        context = self.trajectory.context()
        if isinstance(prompt, list):
            return list(prompt[len(context) :]) if prompt[: len(context)] == context else None
        if context[-1] in renderer.stop_text:  # the answer's text left the sampled stop token out: so may the agent
            context = context[:-1]
        text = renderer.tokenizer.decode(context, skip_special_tokens=False)
        return renderer.encode(prompt[len(text) :]) if prompt.startswith(text) else None


def agent_environments(agent_path: str, tokenizer, stop_ids, sampling, wait_s: float):
    """``make_env(i)`` for the multi-turn backend and the endpoint it serves (closed with it)."""
    from megarl.dotted_path import resolve_dotted_path

    agent = resolve_dotted_path(agent_path, "rollout.agent")
    endpoint = OpenAIEndpoint(ChatRenderer(tokenizer, stop_ids), sampling)

    def make_env(i: int) -> AgentEnvironment:
        return AgentEnvironment(endpoint, agent, wait_s)

    return make_env, endpoint
