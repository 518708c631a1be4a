"""Rewards from a remote service (``reward.url``): batched HTTP, timeouts, retries with backoff.

The protocol is one JSON POST per batch of at most ``batch_size`` samples::

    {"responses": ["...", ...], "answers": ["...", ...], "metas": [{...}, ...]}
    -> {"rewards": [1.0, 0.0, ...]}

Each try has ``timeout_s`` in all, from connecting to the reply's last byte (deadline_http.py: a
server that accepts and never answers, or answers a byte at a time, is cut off there). A request
that fails (connection refused or reset, HTTP error, deadline passed, an answer that is not that
shape) is retried ``retries`` times, waiting ``backoff_s`` x 2^attempt; after the last try
every sample of the batch gets score 0 with a reason naming the URL and the error, and
``reward.on_error`` (the reward executor) decides what the run does with them.
"""

from __future__ import annotations

import json
import math
import time
import urllib.error
from typing import List, Optional, Sequence

from megarl.rewards import deadline_http
from megarl.rewards.scoring import OK, RewardResult


def retried(call, retries: int, backoff_s: float, count=None):
    """``call()`` until it returns, at most ``retries`` + 1 times, waiting ``backoff_s`` x 2^(attempt-1)
    before each retry; ``count()`` before every try. Returns (result, None), or (None, the last error)
    when every try raised a connection, HTTP, timeout or reply-shape error."""
    error = ""
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(backoff_s * 2 ** (attempt - 1))
        if count is not None:
            count()
        try:
            return call(), None
        except (urllib.error.URLError, OSError, ValueError) as exc:  # URLError and timeouts are OSErrors
            error = f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"
    return None, error


class RemoteReward:
    def __init__(
        self,
        url: str,
        timeout_s: float = 30.0,
        retries: int = 2,
        backoff_s: float = 0.5,
        batch_size: int = 64,
    ):
        self.url, self.timeout_s, self.retries = url, timeout_s, retries
        self.backoff_s, self.batch_size = backoff_s, batch_size
        self.requests = 0  # HTTP requests made, retries included
        self.failures = 0  # batches that failed after every retry

    def score(
        self, responses: Sequence[str], answers: Sequence, metas: Optional[Sequence[dict]] = None
    ) -> List[RewardResult]:
        metas = list(metas) if metas is not None else [{} for _ in responses]
        out: List[RewardResult] = []
        for i in range(0, len(responses), self.batch_size):
            out += self._batch(list(responses[i : i + self.batch_size]), list(answers[i : i + self.batch_size]),
                               metas[i : i + self.batch_size])  # fmt: skip
        return out

    def _batch(self, responses: List[str], answers: List, metas: List[dict]) -> List[RewardResult]:
        body = json.dumps({"responses": responses, "answers": answers, "metas": metas}).encode()
        results, error = retried(
            lambda: self._parse(self._post(body), len(responses)), self.retries, self.backoff_s, self._count
        )
        if results is not None:
            return results
        self.failures += 1
        reason = f"error: reward service {self.url} failed after {self.retries + 1} tries ({error})"
        return [RewardResult(0.0, reason) for _ in responses]

    def _count(self) -> None:
        self.requests += 1

    def _post(self, body: bytes) -> bytes:
        return deadline_http.post(self.url, body, self.timeout_s, {"Content-Type": "application/json"})

    @staticmethod
    def _parse(raw: bytes, n: int) -> List[RewardResult]:
        data = json.loads(raw)
        rewards = data.get("rewards") if isinstance(data, dict) else None
        if not isinstance(rewards, list) or len(rewards) != n:
            raise ValueError(f"expected {{'rewards': [{n} numbers]}}, got {str(data)[:200]}")
        out = []
        for r in rewards:
            if not isinstance(r, (int, float)) or isinstance(r, bool) or not math.isfinite(r):
                raise ValueError(f"a reward is not a finite number: {r!r}")
            out.append(RewardResult(float(r), OK))
        return out
