"""The generative judge (reward.judge): what it asks an OpenAI-compatible server (checked against the
openai package's own request parameters by tests/judge_test_server.py), how it reads the verdict,
retries, concurrency, a dead judge named by its URL, and its settings refused where they mean nothing."""

import threading

import pytest

from megarl.config import load_config
from megarl.errors import ConfigError, MegarlError
from megarl.executors.reward import RewardExecutor
from megarl.rewards.judge import DEFAULT_TEMPLATE, JudgeReward
from tests.judge_test_server import even_length_verdict, serve
from tests.unit.test_remote_reward import completions

TINY = "configs/tiny_cpu.yaml"


def _url(server):
    return f"http://127.0.0.1:{server.server_address[1]}/v1"


def _stop(server):
    server.shutdown()
    server.server_close()


def test_the_request_carries_question_answer_and_response_and_the_last_score_counts():
    scripted = {
        "r1": "Score: 1",
        "r2": "The answer is close.\nScore: 0.25",
        "r3": "Score: 1 would need the units too.\nScore: 0",  # the verdict is the last match
        "r4": "I cannot tell.",
        "r5": "Score: 3",
    }
    server = serve(reply=lambda prompt: scripted[prompt.split("Response:\n")[1].split("\n")[0]])
    judge = JudgeReward(_url(server), model="judge-7b", max_tokens=64, temperature=0.0, retries=0)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}]
    results = judge.score(list(scripted), ["5"] * 5, [{"messages": messages}] * 5)
    assert [r.score for r in results[:3]] == [1.0, 0.25, 0.0]
    assert all(r.reason == "ok" for r in results[:3])
    assert "no score in its reply" in results[3].reason and results[3].score == 0.0
    assert "score 3.0 is outside [0, 1]" in results[4].reason and _url(server) in results[4].reason
    request = next(r for r in server.requests if "Response:\nr2\n" in r["messages"][0]["content"])
    assert request["model"] == "judge-7b" and request["max_tokens"] == 64 and request["temperature"] == 0.0
    content = request["messages"][0]["content"]
    # the prompt's last user message is the question, the reference answer and the response follow
    assert "Problem:\nWhat is 2+3?\n" in content and "Reference answer: 5\n" in content
    assert "Be brief." not in content and request["messages"][0]["role"] == "user"
    assert content == DEFAULT_TEMPLATE.format(question="What is 2+3?", answer="5", response="r2")
    _stop(server)


def test_failed_requests_are_retried_and_a_dead_judge_is_named():
    calls = {"n": 0}

    def flaky(prompt):
        calls["n"] += 1
        return 503 if calls["n"] <= 2 else "Score: 1"

    server = serve(reply=flaky)
    judge = JudgeReward(_url(server), concurrency=1, retries=2, backoff_s=0.01)
    assert [r.score for r in judge.score(["a"], ["1"])] == [1.0]
    assert judge.requests == 3 and judge.failures == 0
    url = _url(server)
    _stop(server)
    result = judge.score(["a"], ["1"])[0]
    assert result.score == 0.0 and result.reason.startswith(f"error: judge {url} failed after 3 tries")
    assert judge.failures == 1


def test_requests_run_concurrency_at_a_time():
    # every request waits until four are in the server at once: only a client sending four together passes
    barrier = threading.Barrier(4, timeout=2.0)

    def together(prompt):
        try:
            barrier.wait()
        except threading.BrokenBarrierError:
            return 504
        return "Score: 1"

    server = serve(reply=together)
    four = JudgeReward(_url(server), concurrency=4, retries=0)
    assert [r.reason for r in four.score(["a", "b", "c", "d"], ["1"] * 4)] == ["ok"] * 4
    barrier.reset()
    one = JudgeReward(_url(server), concurrency=1, retries=0)
    assert all(r.reason.startswith("error: judge") for r in one.score(["a", "b"], ["1"] * 2))
    _stop(server)


def test_the_executor_trains_on_the_judges_verdicts_and_names_it_when_it_fails(tmp_path):
    template = tmp_path / "judge.txt"
    template.write_text("Grade it. <<response>>{response}<</response>> (reference: {answer})")
    server = serve()
    url = _url(server)
    base = ["reward.function=null", f"reward.judge.url={url}", f"reward.judge.prompt_file={template}"]
    tok, cs = completions(["ab", "abc", "abcd", "x"])
    scored = RewardExecutor(load_config(TINY, base), tok).score([cs[:2], cs[2:]])
    # the test server's rule, recomputed from the decoded responses
    assert [s.reward for s in scored.samples] == [even_length_verdict(s.response_text) for s in scored.samples]
    assert sorted({s.reward for s in scored.samples}) == [0.0, 1.0]
    assert all("(reference: 1)" in r["messages"][0]["content"] for r in server.requests)
    _stop(server)
    failing = RewardExecutor(load_config(TINY, base + ["reward.on_error=fail", "reward.retries=0"]), tok)
    with pytest.raises(MegarlError, match=f"reward.on_error=fail: reward.judge.url {url}: 4 of 4 samples failed"):
        failing.score([cs[:2], cs[2:]])


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["reward.judge.url=http://h:1/v1"], r"reward.judge.url: a generative judge .*reward.function='math'"),
        (
            ["reward.function=null", "reward.url=http://h:2", "reward.judge.url=http://h:1/v1"],
            r"reward.judge.url: .*reward.url='http://h:2' would too",
        ),
        (["reward.function=null", "reward.judge.url=h:1"], r"reward.judge.url: 'h:1' is not an http"),
        (["reward.judge.model=judge"], r"reward.judge.model: used only with reward.judge.url"),
        (
            ["reward.function=null", "reward.judge.url=http://h/v1", "reward.judge.score_pattern=Score"],
            r"reward.judge.score_pattern: needs exactly one group",
        ),  # fmt: skip
        (
            ["reward.function=null", "reward.judge.url=http://h/v1", "reward.judge.score_pattern=(["],
            r"reward.judge.score_pattern: not a regular expression",
        ),  # fmt: skip
        (
            ["reward.function=null", "reward.judge.url=http://h/v1", "reward.judge.concurrency=0"],
            r"reward.judge.concurrency",
        ),  # fmt: skip
        (
            ["reward.function=null", "reward.judge.url=http://h/v1", "reward.judge.prompt_file=/nonexistent"],
            r"reward.judge.prompt_file: /nonexistent is not a file",
        ),  # fmt: skip
    ],
)
def test_judge_settings_are_checked(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(TINY, overrides)


@pytest.mark.parametrize(
    "text,message",
    [
        ("Grade {response} against {reference}", r"unknown placeholder \{reference\}"),
        ("Grade the answer {answer}", r"never shows the judge the \{response\}"),
        ("Grade {response", r"not a template"),
    ],
)
def test_judge_templates_are_checked(tmp_path, text, message):
    path = tmp_path / "t.txt"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(TINY, ["reward.function=null", "reward.judge.url=http://h/v1", f"reward.judge.prompt_file={path}"])


def test_retries_are_used_with_a_judge():
    cfg = load_config(TINY, ["reward.function=null", "reward.judge.url=http://h/v1", "reward.retries=5"])
    assert cfg.reward.retries == 5 and cfg.reward.judge.url == "http://h/v1"
