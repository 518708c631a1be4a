"""`megarl train` of a tiny random Qwen3-MoE end to end (configs/tiny_moe_cpu.yaml): trainer EP2 over
DP2 (Megatron's MoE layers, alltoall dispatcher over gloo), one torch-engine replica at TP2 with
SGLang's --ep-size 2 layout, async, every weight sync verified by checksums.

What the engine and the trainer compute are compared through the loop's own records: tokens a
generator sampled under the policy version the trainer then holds (lag 0) have behaviour log-probs
equal to Megatron's log-probs of them, which needs every expert, router, q/k norm and the routing
itself to agree after each sync. The model is a converted Hugging Face checkpoint with transformers'
random init at a large scale (tests/conftest.py make_tiny_family), not Megatron's 0.02-std init:
that one's nearly uniform outputs hide a wrong expert (measured: a generator using the wrong expert
half moved KL(mu || pi) of lag-0 tokens to 1.05e-5 only)."""

import math

import pytest

from tests.conftest import make_tiny_family
from tests.fp32_bounds import fp32_logprob_bound as shared_logprob_bound
from tests.multiprocess.test_rl_loop import REWARD, _train
from tests.unit.test_rl_loop import ROOT

pytestmark = pytest.mark.slow


# How far two fp32 computations of one token's log-prob may differ, from the arithmetic (the model
# test_conversion_families.py uses for logits): a sum of n fp32 terms errs by about LAMBDA sqrt(n) u of
# its terms' scale (Higham & Mary, SIAM J. Sci. Comput. 2019), u = 2**-24. The logits chain S = 6 L + 1
# reductions (QKV, scores, scores x V, output projection, gate/up, down per layer, then the head), n the
# longest: LAMBDA sqrt(S n) u max|logit|. log p = z - logsumexp(z) adds the token's logit error and (at
# most) the same again through logsumexp, whose sum over the vocabulary errs by LAMBDA sqrt(V) u more,
# relative to a sum >= 1: eps = 2 LAMBDA sqrt(S n) u max|logit| + LAMBDA sqrt(V) u per side, and the
# generator's and trainer's errors add in quadrature, delta = sqrt(2) eps. A token's k3 term
# e^x - 1 - x with |x| <= delta is at most delta^2 e^delta / 2, which bounds KL(mu || pi) at lag 0.
# max|logit| is taken on the checkpoint's weights over the rollouts' sequences (the steps move the
# weights by lr 1e-3 Adam steps, a percent of their 0.2 scale). The guarded mistake (a generator using
# the wrong expert half) moved that KL to 1.05e-5: ~500x this bound, where the 1e-5 it replaces sat at
# 0.95 of it.
def fp32_logprob_bound(hf, rollouts) -> float:
    """delta above: the largest |log pi_a - log pi_b| of two fp32 computations of one token."""
    sequences = [r["prompt_tokens"] + r["response_tokens"] for r in rollouts]
    return shared_logprob_bound(hf, sequences, experts_implementation="eager")


def k3_bound(delta: float) -> float:
    return delta**2 * math.exp(delta) / 2


def test_tiny_moe_trains_async_with_verified_expert_sync(tmp_path):
    # SmolLM2's vocabulary size, for the config's tokenizer and arithmetic prompts
    hf = make_tiny_family("qwen3_moe", tmp_path / "hf", norm_topk_prob=True, vocab_size=49152)
    summary, metrics, rollouts = _train(
        tmp_path / "moe",
        f"model.source={hf}",
        f"model.cache_dir={tmp_path / 'cache'}",
        f"reward.function={REWARD}",
        "trainer.entropy_coef=0.1",
        config=str(ROOT / "configs" / "tiny_moe_cpu.yaml"),
    )
    assert [m["step"] for m in metrics] == [1, 2, 3] and summary["samples"] == 24
    assert all(m["weight_sync_verified"] for m in metrics)
    assert all(m["grad_norm"] > 0 for m in metrics)  # experts and router trained
    lag0 = [m for m in metrics if m["tokens_lag0"] > 0]
    assert lag0 and lag0[0]["step"] == 1
    bound = k3_bound(fp32_logprob_bound(hf, rollouts))
    print(f"KL(mu || pi) at lag 0: {[m['kl_mu_pi_lag0'] for m in lag0]}; bound {bound:.2e}")
    for m in lag0:  # the generator's experts are the trainer's after every sync
        assert m["kl_mu_pi_lag0"] <= bound, (m, bound)
    # the policy moved: stale tokens' ratios are away from 1 (a sync that delivered nothing would
    # leave the lag-0 check above passing only at step 1)
    assert any(m["ess"] < 1 - 1e-4 for m in metrics[1:]), [m["ess"] for m in metrics]
    assert len({r["reward"] for r in rollouts}) > 1
    # the config's aux losses are logged each step, overall and for each MoE layer (1-3; layer 0 is dense)
    for m in metrics:
        layers = sorted(k for k in m if k.startswith("moe_load_balancing_loss/"))
        assert layers == [f"moe_load_balancing_loss/layer{i}" for i in (1, 2, 3)], m
        # 1 when balanced, E / top_k = 2 at most (every token and all probability on one expert)
        assert 0.5 < m["moe_load_balancing_loss"] <= 2 and m["moe_z_loss"] > 0, m


def _check_replayed(hf, metrics, rollouts, num_layers=4, top_k=2, experts=4):
    """Routing replay end to end: every step took every real token x MoE layer route from the generator;
    the routes in rollouts.jsonl are per fed position ([prompt + response - 1, layers, top_k], -1 on the
    dense layer 0); and step 1's trainer log-probs (weights = the checkpoint's) are transformers' model
    forced to exactly those routes: an off-by-one in the routes' positions or a lost layer moves them."""
    import torch
    from transformers import AutoModelForCausalLM

    from megarl.loop.routes_json import decode_routes
    from tests.rl_batch import forced_routes, response_logprobs

    assert [m["moe_routes_replayed"] for m in metrics] == [1.0] * len(metrics), metrics
    first = [r for r in rollouts if r["step"] == 1]
    assert first
    delta = fp32_logprob_bound(hf, first)
    print(f"step 1: KL(mu || pi) {metrics[0]['kl_mu_pi']:.2e}, bound {k3_bound(delta):.2e}")
    assert metrics[0]["kl_mu_pi"] <= k3_bound(delta), (metrics[0], k3_bound(delta))
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    for r in rollouts:
        routes = decode_routes(r["routed_experts"], "rollouts.jsonl")
        assert tuple(routes.shape) == (len(r["prompt_tokens"]) + len(r["response_tokens"]) - 1, num_layers, top_k)
        assert (routes[:, 0] == -1).all() and routes[:, 1:].min() >= 0 and routes[:, 1:].max() < experts
    worst = 0.0
    for r in first:
        routes = decode_routes(r["routed_experts"], "rollouts.jsonl")
        with torch.no_grad(), forced_routes(model, routes):
            ref = response_logprobs(model, r["prompt_tokens"], r["response_tokens"], 1.0)
        worst = max(worst, (torch.tensor(r["trainer_logprobs"]) - ref).abs().max().item())
    print(f"step 1: max |trainer log-prob - transformers'| {worst:.2e}, bound {delta:.2e}")
    assert worst <= delta, (worst, delta)


def test_tiny_moe_trains_with_the_generators_routes_replayed(tmp_path):
    """trainer.moe_enable_routing_replay with the torch engine (TP2, SGLang's EP2 layout)."""
    hf = make_tiny_family("qwen3_moe", tmp_path / "hf", norm_topk_prob=True, vocab_size=49152)
    summary, metrics, rollouts = _train(
        tmp_path / "moe",
        f"model.source={hf}",
        f"model.cache_dir={tmp_path / 'cache'}",
        f"reward.function={REWARD}",
        "trainer.moe_enable_routing_replay=true",
        config=str(ROOT / "configs" / "tiny_moe_cpu.yaml"),
    )
    assert [m["step"] for m in metrics] == [1, 2, 3] and all(m["weight_sync_verified"] for m in metrics)
    _check_replayed(hf, metrics, rollouts)


def test_tiny_moe_replays_routes_sglang_returned(tmp_path):
    """The same through generator.backend=sglang: the job launches the protocol test server with
    --ep-size 2 and --enable-return-routed-experts (flags checked against SGLang's ServerArgs), every
    /generate asks return_routed_experts, and the answers' routed_experts (SGLang's int32 base64, dense
    layers 0) are what the trainer replays."""
    import json
    import sys

    from tests.conftest import _env, server_port

    hf = make_tiny_family("qwen3_moe", tmp_path / "hf", norm_topk_prob=True, vocab_size=49152)
    stats = tmp_path / "stats.json"
    env = dict(_env(), SGLANG_TEST_STATS=str(stats))
    summary, metrics, rollouts = _train(
        tmp_path / "moe",
        f"model.source={hf}",
        f"model.cache_dir={tmp_path / 'cache'}",
        f"reward.function={REWARD}",
        "trainer.moe_enable_routing_replay=true",
        "generator.backend=sglang",
        f"generator.sglang_launcher={sys.executable} {ROOT / 'tests' / 'sglang_test_server.py'}",
        f"generator.sglang_port={server_port()}",
        config=str(ROOT / "configs" / "tiny_moe_cpu.yaml"),
        env=env,
    )
    log = (tmp_path / "moe" / "sglang" / "replica0.log").read_text()
    assert "--ep-size 2" in log and "--enable-return-routed-experts" in log
    served = json.loads(stats.read_text())
    assert served["routed_experts_answers"] >= summary["samples"], served
    assert [m["step"] for m in metrics] == [1, 2, 3] and all(m["weight_sync_verified"] for m in metrics)
    _check_replayed(hf, metrics, rollouts)
