"""Routing replay where it matters: a router near ties, a generator in another precision.

The tiny Qwen3-MoE's routers are squeezed towards one row (every expert's logit nearly equal), and
the torch engine samples in bf16 while the trainer runs fp32 -- as SGLang serves bf16 / fp8 beside
a higher-precision trainer. Then the generator's top-k often differs from the trainer's, the
importance ratio compares two networks, and only replaying the generator's routes brings the
trainer back to the network that sampled. Both arms train the same recorded samples at PP2 x VPP2
(one layer per virtual stage, four micro-batches per rank, so 1F1B interleaves forwards and
backwards) with full recomputation (routers re-run in backward); the trainer's log-probs are
compared with transformers' fp32 model routed by its own top-k (no replay) and forced to the
generator's experts (replay)."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import make_tiny_family, run_ranks, run_tool
from tests.rl_batch import (
    GROUPS,
    POSITIONS,
    PROMPT_LENGTHS,
    REWARDS,
    VERSION,
    forced_routes,
    response_logprobs,
    save_samples,
)

pytestmark = pytest.mark.slow

TEMPERATURE = 0.8
SQUEEZE = 1e-3  # router rows -> row 0 + SQUEEZE x (row - row 0): logit gaps of 1e-3 of the usual
LAYOUT = "1x2x2e2rc"  # PP2 x VPP2 x EP2 (DP2) over 4 ranks, full recompute
RUNS = [f"{LAYOUT}:16", f"{LAYOUT}replay:16"]


def near_tie_model(path):
    hf = make_tiny_family("qwen3_moe", path)
    weights = load_file(hf / "model.safetensors")
    for name in [n for n in weights if n.endswith("mlp.gate.weight")]:
        gate = weights[name]
        weights[name] = (gate[:1] + SQUEEZE * (gate - gate[:1])).contiguous()
    save_file(weights, hf / "model.safetensors", metadata={"format": "pt"})
    return hf


def generated_samples(hf):
    """Eight samples of 16 positions each, sampled by the torch engine in bf16, with its routes."""
    from megarl.generator.interface import GenerationRequest, SamplingParams
    from megarl.generator.torch_engine.engine import TorchEngine
    from megarl.generator.weights import load_generator_params
    from megarl.models.hf_checkpoint import SafetensorsCheckpoint
    from megarl.rollout import Sample

    checkpoint = SafetensorsCheckpoint(hf)
    engine = TorchEngine(
        checkpoint.spec, load_generator_params(checkpoint, 1, 0, torch.bfloat16), max_running=8, max_seq_len=64
    )
    g = torch.Generator().manual_seed(1)
    engine.submit(
        [
            GenerationRequest(
                str(i),
                torch.randint(0, 300, (p,), generator=g).tolist(),
                SamplingParams(temperature=TEMPERATURE, max_new_tokens=POSITIONS + 1 - p, seed=i),
            )
            for i, p in enumerate(PROMPT_LENGTHS)
        ]
    )
    done = sorted(engine.run_until_idle(), key=lambda c: int(c.request_id))
    samples = []
    for i, c in enumerate(done):
        assert len(c.prompt_ids) + len(c.output_ids) - 1 == POSITIONS  # no stop token: fixed length
        versions = [VERSION] * len(c.output_ids)  # the trainer's own version: lag 0 everywhere
        samples.append(
            Sample(
                c.prompt_ids, c.output_ids, c.logprobs, versions, REWARDS[i], GROUPS[i], routed_experts=c.routed_experts
            )
        )
    return samples


@pytest.fixture(scope="module")
def near_ties(tmp_path_factory):
    base = tmp_path_factory.mktemp("moe_near_ties")
    hf = near_tie_model(base / "hf")
    run_tool("convert_hf_to_megatron.py", "--hf-model", hf, "--output", base / "megatron")
    samples = generated_samples(hf)
    save_samples(samples, base / "samples.pt")
    run_ranks(
        4,
        "rl_grad_worker.py",
        "--checkpoint",
        base / "megatron",
        "--samples",
        base / "samples.pt",
        "--out",
        base,
        "--runs",
        *RUNS,
    )
    records = {run: json.loads((base / f"{run.replace(':', '_')}_aipo.json").read_text()) for run in RUNS}
    return hf, samples, records


def _k3(samples, trainer_logprobs):
    """KL(mu || pi) on the sampled tokens as the k3 estimate, the mean of r - 1 - log r with
    r = pi / mu: every token's term is >= 0, so tokens where pi > mu cannot cancel those where it is
    below (the plain mean of log mu - log pi can, and on eight short samples does)."""
    terms = [
        math.exp(p - m) - 1 - (p - m)
        for s, pis in zip(samples, trainer_logprobs)
        for m, p in zip(s.behaviour_logprobs, pis)
    ]
    return sum(terms) / len(terms)


def test_replay_removes_the_routing_mismatch(near_ties):
    """Without replay the trainer disagrees with the generator on a share of the routes and the
    mismatch KL is large; replay takes every route and leaves only the precision gap. Fails if replay
    is silently off (both arms then equal) or observes nothing.

    What replay guarantees on any CPU is the ratio, not a level: at these near ties the bf16
    generator's and the fp32 trainer's top-2 of 4 are close to independent (chance agreement 1/6),
    so the mismatch KL without replay depends on which experts each picked for the few tokens
    sampled (k3 0.114 on an AVX512-BF16 EPYC, 0.092 as an AVX2 one computes it), while replay leaves the
    bf16 rounding alone (k3 5.0e-4 and 4.8e-4): 228x and 193x."""
    _, samples, records = near_ties
    off, on = records[RUNS[0]], records[RUNS[1]]
    kl_off, kl_on = _k3(samples, off["trainer_logprobs"]), _k3(samples, on["trainer_logprobs"])
    agreement = off["moe_metrics"]["moe_route_agreement"]
    print(
        f"agreement {agreement:.3f}; KL(mu||pi) without replay {kl_off:.2e} (megarl's "
        f"{off['metrics']['kl_mu_pi']:.2e}), with {kl_on:.2e} (megarl's {on['metrics']['kl_mu_pi']:.2e})"
    )
    # routes disagree, but not below chance (half of 1/6 would mean anti-correlated indices: a bug)
    assert 1 / 12 < agreement < 0.95
    assert off["moe_metrics"]["moe_routes_replayed"] == 0.0 and on["moe_metrics"]["moe_routes_replayed"] == 1.0
    assert kl_off > 20 * kl_on
    # megarl's own metric is the same k3 over the same tokens
    for arm, kl in ((off, kl_off), (on, kl_on)):
        assert arm["metrics"]["kl_mu_pi"] == pytest.approx(kl, rel=1e-3)


def test_trainer_logprobs_are_transformers_routed_as_each_arm_says(near_ties):
    """Under PP2 x VPP2 with recomputation, the replaying trainer's log-probs are transformers' fp32
    model forced to the generator's experts, and the other arm's are its own routing: the two
    references differ by far more than the bound."""
    from transformers import AutoModelForCausalLM

    hf, samples, records = near_ties
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    apart = 0.0
    for i, s in enumerate(samples):
        with torch.no_grad():
            own = response_logprobs(model, s.prompt_tokens, s.response_tokens, TEMPERATURE)
            with forced_routes(model, s.routed_experts):
                forced = response_logprobs(model, s.prompt_tokens, s.response_tokens, TEMPERATURE)
        apart = max(apart, (own - forced).abs().max().item())
        off = torch.tensor(records[RUNS[0]]["trainer_logprobs"][i])
        on = torch.tensor(records[RUNS[1]]["trainer_logprobs"][i])
        assert (off - own).abs().max().item() < 1e-4, i
        assert (on - forced).abs().max().item() < 1e-4, i
    assert apart > 1e-1
