"""The evaluation record of several named held-out sets: each set's sums over the replicas under its
own keys (one unnamed set keeps the plain eval_* keys), and the responses file tagged by set."""

import json

import pytest

from megarl.executors.evaluator import EvalCollector


class Store(dict):
    def set(self, key, value):
        self[key] = value

    def check(self, keys):
        return all(k in self for k in keys)


class Writer(list):
    def write(self, record):
        self.append(record)


def sums(n, correct, greedy, sampled, passed, seconds, tag):
    return {"n": n, "correct": correct, "greedy_reward": greedy, "sampled_reward": sampled, "pass": passed,
            "seconds": seconds, "responses": [{"prompt_index": i, "response": f"{tag}{i}"} for i in range(n)]}  # fmt: skip


def test_named_sets_are_merged_over_replicas_under_their_own_keys(tmp_path):
    store, writer = Store(), Writer()
    posts = [
        {"heldout": sums(3, 1, 1.0, 2.0, 2, 4.0, "h0-"), "ood": sums(2, 2, 2.0, 3.0, 2, 1.0, "o0-")},
        {"heldout": sums(2, 1, 1.5, 1.0, 1, 5.0, "h1-"), "ood": sums(2, 0, 0.0, 0.5, 1, 2.0, "o1-")},
    ]
    for replica, p in enumerate(posts):
        store.set(f"megarl/eval/3/{replica}", json.dumps(p))
    c = EvalCollector(store, replicas=2, samples=2, out=tmp_path)
    c.expect(3)
    c.collect(writer)
    [r] = writer
    assert (r["step"], r["eval"], r["eval_heldout_n"], r["eval_ood_n"]) == (3, True, 5, 4)
    assert r["eval_heldout_accuracy"] == pytest.approx(2 / 5) and r["eval_ood_accuracy"] == pytest.approx(2 / 4)
    assert r["eval_heldout_greedy_reward_mean"] == pytest.approx(2.5 / 5)
    assert r["eval_ood_reward_mean@2"] == pytest.approx(3.5 / (4 * 2)) and r["eval_ood_pass@2"] == pytest.approx(3 / 4)
    assert r["eval_heldout_time_s"] == 5.0 and "eval_accuracy" not in r
    lines = [json.loads(x) for x in (tmp_path / "eval" / "step_3.jsonl").read_text().splitlines()]
    assert [(x["set"], x["replica"], x["response"]) for x in lines][:4] == [
        ("heldout", 0, "h0-0"), ("heldout", 0, "h0-1"), ("heldout", 0, "h0-2"), ("heldout", 1, "h1-0")]  # fmt: skip
    assert sum(x["set"] == "ood" for x in lines) == 4


def test_one_unnamed_set_keeps_the_plain_keys(tmp_path):
    store, writer = Store(), Writer()
    store.set("megarl/eval/0/0", json.dumps({"": sums(4, 3, 3.0, 0.0, 0, 1.0, "x")}))
    c = EvalCollector(store, replicas=1, samples=1, out=tmp_path)
    c.expect(0)
    c.collect(writer)
    assert writer == [{"step": 0, "eval": True, "eval_n": 4, "eval_accuracy": 0.75, "eval_greedy_reward_mean": 0.75,
                       "eval_time_s": 1.0}]  # fmt: skip
    assert "set" not in json.loads((tmp_path / "eval" / "step_0.jsonl").read_text().splitlines()[0])
