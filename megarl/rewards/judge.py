"""A generative judge (``reward.judge.url``): a language model grades each response through an
OpenAI-compatible chat-completions endpoint.

The judge is a server of its own -- an SGLang or vLLM server holding the judge model
(``python -m sglang.launch_server --model-path JUDGE``; its /v1 routes), or any service speaking
the same protocol -- not a replica of the policy being trained: a judge that moved with the policy
would be graded by what it is learning. Each sample is one request::

    POST {url}/chat/completions
    {"model": M, "messages": [{"role": "user", "content": <the prompt template, filled>}],
     "temperature": T, "max_tokens": N}
    -> {"choices": [{"message": {"content": "... Score: 1"}}], ...}

The template's ``{question}`` (the prompt's last user message), ``{answer}`` (the record's reference
answer) and ``{response}`` (the decoded response) are filled in; the score is the last match of
``score_pattern``'s one group in the judge's reply, a number in [0, 1]. Requests run ``concurrency``
at a time, each try with ``reward.timeout_s`` in all (deadline_http.py: a judge that accepts and never
answers, or drips its reply, is cut off there) and ``reward.retries`` retries with exponential backoff. A
reply with no score, a score outside [0, 1], or a request that failed after its retries scores 0
with a reason naming the URL, and ``reward.on_error`` decides what the run does with it, as for
every other reward.
"""

from __future__ import annotations

import json
import math
import re
from concurrent.futures import ThreadPoolExecutor
from typing import List, Optional, Sequence

from megarl.config import JUDGE_SCORE_PATTERN, judge_template_fields
from megarl.rewards import deadline_http
from megarl.rewards.remote import retried
from megarl.rewards.scoring import OK, RewardResult

DEFAULT_TEMPLATE = """You are grading a response to a problem against its reference answer.

Problem:
{question}

Reference answer: {answer}

Response:
{response}

Does the response's final answer equal the reference answer? Think briefly, then end with one line:
"Score: 1" if it does, "Score: 0" if it does not."""


def question_of(meta: dict) -> str:
    """The prompt's last user message (a chat record's question), else ""."""
    for message in reversed(meta.get("messages") or []):
        if message.get("role") == "user":
            return str(message.get("content", ""))
    return ""


class JudgeReward:
    def __init__(
        self,
        url: str,
        model: str = "default",
        template: str = DEFAULT_TEMPLATE,
        score_pattern: str = JUDGE_SCORE_PATTERN,
        max_tokens: int = 512,
        temperature: float = 0.0,
        concurrency: int = 8,
        timeout_s: float = 30.0,
        retries: int = 2,
        backoff_s: float = 0.5,
    ):
        judge_template_fields(template, "the judge's template")  # a bad one fails here, not per sample
        self.url = url.rstrip("/")
        self.model, self.template, self.max_tokens, self.temperature = model, template, max_tokens, temperature
        self.pattern = re.compile(score_pattern)
        self.concurrency, self.timeout_s, self.retries, self.backoff_s = concurrency, timeout_s, retries, backoff_s
        self.requests = 0  # HTTP requests made, retries included (+= under the GIL: threads only add)
        self.failures = 0  # samples whose request failed after every retry

    def prompt(self, response: str, answer, meta: dict) -> str:
        return self.template.format(question=question_of(meta), answer=answer, response=response)

    def score(
        self, responses: Sequence[str], answers: Sequence, metas: Optional[Sequence[dict]] = None
    ) -> List[RewardResult]:
        metas = list(metas) if metas is not None else [{} for _ in responses]
        prompts = [self.prompt(r, a, m) for r, a, m in zip(responses, answers, metas)]
        with ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="megarl-judge") as pool:
            return list(pool.map(self._one, prompts))

    def _one(self, prompt: str) -> RewardResult:
        body = json.dumps(
            {
                "model": self.model,
                "messages": [{"role": "user", "content": prompt}],
                "temperature": self.temperature,
                "max_tokens": self.max_tokens,
            }
        ).encode()
        reply, error = retried(lambda: self._reply(self._post(body)), self.retries, self.backoff_s, self._count)
        if reply is not None:
            return self.parse(reply)
        self.failures += 1
        return RewardResult(0.0, f"error: judge {self.url} failed after {self.retries + 1} tries ({error})")

    def _count(self) -> None:
        self.requests += 1

    def _post(self, body: bytes) -> bytes:
        return deadline_http.post(
            self.url + "/chat/completions", body, self.timeout_s, {"Content-Type": "application/json"}
        )

    @staticmethod
    def _reply(raw: bytes) -> str:
        """The first choice's message content of a chat.completion; ValueError if it is not one
        (retried: a server mid-restart can answer with an error page)."""
        data = json.loads(raw)
        try:
            content = data["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise ValueError(f"not a chat completion: {str(data)[:200]}") from None
        if not isinstance(content, str):
            raise ValueError(f"the judge's message content is {type(content).__name__}, not text")
        return content

    def parse(self, reply: str) -> RewardResult:
        """The score in the judge's reply: the last match of the pattern (a judge that reasons first may
        quote the format before its verdict). Not retried: at temperature 0 the same prompt gives the
        same reply."""
        matches = self.pattern.findall(reply)
        if not matches:
            return RewardResult(0.0, f"error: judge {self.url}: no score in its reply: {reply[-200:]!r}")
        text = matches[-1]
        try:
            value = float(text)
        except ValueError:
            return RewardResult(0.0, f"error: judge {self.url}: score {text!r} is not a number")
        if not math.isfinite(value) or not 0.0 <= value <= 1.0:
            return RewardResult(0.0, f"error: judge {self.url}: score {value} is outside [0, 1]")
        return RewardResult(value, OK)
