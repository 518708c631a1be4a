"""The remote reward service client and reward.on_error: batched requests, retries, a dead service named
by its URL, and what each policy makes of failed samples."""

from pathlib import Path

import pytest

from megarl.config import load_config
from megarl.errors import ConfigError, MegarlError
from megarl.executors.reward import RewardExecutor
from megarl.generator.interface import Completion
from megarl.rewards.remote import RemoteReward
from tests.reward_test_server import even_length, serve

TINY = "configs/tiny_cpu.yaml"


def test_batches_retries_and_a_dead_service():
    server = serve(fail_first=1)
    url = f"http://127.0.0.1:{server.server_address[1]}/score"
    client = RemoteReward(url, timeout_s=5, retries=2, backoff_s=0.01, batch_size=3)
    texts = ["ab", "abc", "", "abcd", "x"]
    results = client.score(texts, ["1"] * 5, [{"i": i} for i in range(5)])
    assert [r.score for r in results] == [even_length(t) for t in texts] and all(r.reason == "ok" for r in results)
    # two batches (3 + 2), the first answered after one retry
    assert [len(b["responses"]) for b in server.requests] == [3, 3, 2] and client.requests == 3
    assert server.requests[2]["metas"] == [{"i": 3}, {"i": 4}]
    server.shutdown()
    server.server_close()
    results = client.score(["ab"], ["1"])
    assert results[0].score == 0.0 and results[0].reason.startswith(f"error: reward service {url} failed after 3 tries")
    assert client.failures == 1


def completions(texts):
    from megarl.generator.tokenizer import load_tokenizer
    from megarl.model_source import _smollm2_tokenizer

    tok = load_tokenizer(_smollm2_tokenizer(Path(load_config(TINY).model.cache_dir)))
    ids = [tok.encode(t, add_special_tokens=False) for t in texts]
    return tok, [Completion(f"g{i // 2}", i % 2, i // 2, [1], x, [-0.1] * len(x), [0] * len(x), "stop", meta={"answer": "1"})
                 for i, x in enumerate(ids)]  # fmt: skip


@pytest.mark.parametrize("policy", ["zero", "drop", "fail"])
def test_on_error_policies_with_a_dead_service(policy):
    server = serve()
    port = server.server_address[1]
    server.shutdown()
    server.server_close()  # nothing listens on the port any more
    url = f"http://127.0.0.1:{port}/score"
    cfg = load_config(
        TINY, ["reward.function=null", f"reward.url={url}", f"reward.on_error={policy}", "reward.retries=0"]
    )
    tok, cs = completions(["ab", "abc", "abcd", "x"])
    executor = RewardExecutor(cfg, tok)
    groups = [cs[:2], cs[2:]]
    if policy == "fail":
        with pytest.raises(MegarlError, match=f"reward.on_error=fail: reward.url {url}: 4 of 4 samples failed"):
            executor.score(groups)
        return
    scored = executor.score(groups)
    if policy == "zero":
        assert [s.reward for s in scored.samples] == [0.0] * 4 and scored.reward_timeouts == 4
        assert all(url in s.reward_reason for s in scored.samples)
    else:
        assert scored.samples == [] and scored.dropped_groups == 2 and scored.reward_timeouts == 0


def test_a_live_service_scores_and_drop_keeps_good_groups():
    server = serve()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    cfg = load_config(TINY, ["reward.function=null", f"reward.url={url}", "reward.on_error=drop"])
    tok, cs = completions(["ab", "abc", "abcd", "x"])
    scored = RewardExecutor(cfg, tok).score([cs[:2], cs[2:]])
    assert [s.reward for s in scored.samples] == [even_length(s.response_text) for s in scored.samples]
    assert len(scored.samples) == 4 and scored.dropped_groups == 0
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["reward.url=http://h:1"], r"reward.url: a reward service scores the samples; reward.function='math'"),
        (["reward.function=null", "reward.url=h:1"], r"reward.url: 'h:1' is not an http"),
        (["reward.on_error=skip"], r"reward.on_error"),
        (["reward.retries=3"], r"reward.retries: used only with reward.url"),
        (["reward.function=null", "reward.url=http://h:1", "reward.retries=-1"], r"reward.retries: must be >= 0"),
    ],
)
def test_reward_settings_are_checked(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(TINY, overrides)
