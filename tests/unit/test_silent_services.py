"""Remote services that accept a connection and never answer (tests/silent_servers.py: silent, or a
reply dripped a byte every 0.25 s, which resets any per-read timeout): the reward service and the
judge end each try at reward.timeout_s in all and the batch goes to reward.on_error; an agent
waiting on such a server ends its episode at rollout.env_timeout_s. Each call ends within its bound
plus MARGIN_S = 2 s (thread start-up and the scheduler of a shared 2-core machine; the drip alone would
hold a caller for 100000 x 0.25 s)."""

import time
import urllib.request

import pytest

from megarl.config import load_config
from megarl.errors import MegarlError
from megarl.executors.reward import RewardExecutor
from megarl.rewards.judge import JudgeReward
from megarl.rewards.remote import RemoteReward
from tests.silent_servers import serve
from tests.unit.test_openai_endpoint import ANSWER_TEXT, CALL_TEXT, run_episode, tokenizer  # noqa: F401
from tests.unit.test_remote_reward import TINY, completions

TIMEOUT_S, RETRIES, BACKOFF_S, MARGIN_S = 1.0, 1, 0.05, 2.0
BOUND_S = (RETRIES + 1) * TIMEOUT_S + BACKOFF_S + MARGIN_S  # every try, the backoff between them


@pytest.fixture(params=["silent", "drip"])
def server(request):
    s = serve(request.param)
    yield s
    s.stop()


def _timed(call):
    start = time.perf_counter()
    out = call()
    return out, time.perf_counter() - start


def test_a_reward_service_that_never_answers_is_cut_off_at_its_deadline(server):
    url = f"http://127.0.0.1:{server.port}/score"
    client = RemoteReward(url, timeout_s=TIMEOUT_S, retries=RETRIES, backoff_s=BACKOFF_S)
    results, seconds = _timed(lambda: client.score(["ab", "abc"], ["1", "1"]))
    assert seconds < BOUND_S, seconds
    assert seconds > (RETRIES + 1) * TIMEOUT_S - 0.1  # it waited each try out, it did not fail at once
    reason = f"error: reward service {url} failed after {RETRIES + 1} tries (DeadlineExceeded: no complete reply"
    assert [r.score for r in results] == [0.0, 0.0] and all(r.reason.startswith(reason) for r in results), results
    assert server.connections == RETRIES + 1 and client.failures == 1


def test_a_judge_that_never_answers_is_cut_off_at_its_deadline(server):
    url = f"http://127.0.0.1:{server.port}/v1"
    judge = JudgeReward(url, timeout_s=TIMEOUT_S, retries=RETRIES, backoff_s=BACKOFF_S, concurrency=4)
    results, seconds = _timed(lambda: judge.score(["a", "bb", "ccc", "dddd"], ["1"] * 4))
    assert seconds < BOUND_S, seconds  # four samples, four at a time: one sample's bound
    reason = f"error: judge {url} failed after {RETRIES + 1} tries (DeadlineExceeded: no complete reply"
    assert all(r.score == 0.0 and r.reason.startswith(reason) for r in results), results
    assert server.connections == 4 * (RETRIES + 1) and judge.failures == 4


def test_a_drip_outlasts_a_per_read_timeout():
    """Why a total deadline: urllib's own timeout (per socket operation) is still reading the drip
    when three times the same timeout_s has passed."""
    import threading

    server = serve("drip")
    ended = []

    def read():
        request = urllib.request.Request(f"http://127.0.0.1:{server.port}/score", data=b"{}")
        try:
            urllib.request.urlopen(request, timeout=TIMEOUT_S).read()
        except OSError as exc:
            ended.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(3 * TIMEOUT_S)
    still_reading = reader.is_alive()
    server.stop()  # closing its connection ends the read
    reader.join(5)
    assert still_reading and not reader.is_alive()


@pytest.mark.parametrize("policy", ["zero", "drop", "fail"])
def test_on_error_decides_what_a_silent_service_becomes(policy):
    server = serve("drip")
    url = f"http://127.0.0.1:{server.port}/score"
    cfg = load_config(TINY, ["reward.function=null", f"reward.url={url}", f"reward.on_error={policy}",
                             "reward.retries=0", f"reward.timeout_s={TIMEOUT_S}"])  # fmt: skip
    tok, cs = completions(["ab", "abc", "abcd", "x"])
    executor = RewardExecutor(cfg, tok)
    start = time.perf_counter()
    try:
        if policy == "fail":
            with pytest.raises(MegarlError, match=f"reward.on_error=fail: reward.url {url}: 4 of 4 samples failed"):
                executor.score([cs[:2], cs[2:]])
        else:
            scored = executor.score([cs[:2], cs[2:]])
            if policy == "zero":
                assert [s.reward for s in scored.samples] == [0.0] * 4 and scored.reward_timeouts == 4
                assert all("DeadlineExceeded" in s.reward_reason for s in scored.samples)
            else:
                assert scored.samples == [] and scored.dropped_groups == 2
    finally:
        server.stop()
    assert time.perf_counter() - start < TIMEOUT_S + MARGIN_S


SILENT = {}


def agent_behind_a_silent_server(task):
    """An agent that makes its first call, then waits on a tool server of its own that never answers
    (no timeout of its own: the agent's bug, not megarl's)."""
    import openai

    client = openai.OpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
    client.chat.completions.create(model=task.model, messages=task.messages)
    urllib.request.urlopen(f"http://127.0.0.1:{SILENT['port']}/tool", data=b"{}").read()


def test_an_agent_stuck_on_a_silent_server_ends_its_episode_at_env_timeout(tokenizer):  # noqa: F811
    server = serve("silent")
    SILENT["port"] = server.port
    env_timeout_s = 1.5
    try:
        (t, c, _, episodes), seconds = _timed(
            lambda: run_episode(
                tokenizer,
                "tests.unit.test_silent_services:agent_behind_a_silent_server",
                [CALL_TEXT, ANSWER_TEXT],
                env_timeout_s=env_timeout_s,
            )  # fmt: skip
        )
    finally:
        server.stop()
    assert t.finish == "env_timeout" and server.connections == 1
    assert episodes.counters["env_timeouts"] == 1
    assert seconds < env_timeout_s + MARGIN_S + 2.0, seconds  # + the tokenizer's first render
