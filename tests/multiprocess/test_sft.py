"""`megarl sft` end to end: the first step's loss is transformers' own negative log-likelihood of the
responses' tokens under the same weights (prompt tokens excluded), the loss falls over epochs, and the
run ends with a checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT, _env, make_tiny_llama

pytestmark = pytest.mark.slow

PAIRS = [(1, 2), (3, 4), (5, 6), (7, 8), (2, 2), (9, 1), (4, 4), (6, 3)]


def test_sft_loss_is_transformers_nll_of_the_responses(tmp_path):
    from transformers import AutoTokenizer, LlamaForCausalLM

    hf = make_tiny_llama(tmp_path / "hf", vocab_size=49152)  # SmolLM2's vocabulary, for its tokenizer
    data = tmp_path / "data.jsonl"
    records = [{"prompt": f"What is {a}+{b}?", "response": f"{a + b}"} for a, b in PAIRS]
    data.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "megarl.cli", "sft", "--config", str(ROOT / "configs" / "tiny_cpu.yaml"),
           "--data", str(data), "--epochs", "4", "--batch-size", "8", f"model.source={hf}",
           "model.tokenizer=smollm2", f"model.cache_dir={tmp_path / 'cache'}", f"run.output_dir={out}",
           "run.progress=false", "optimizer.lr=3e-3",
           # an RL config's loss settings, as configs/demo_cpu.yaml's: AIPO's parameter and the sampler's
           # temperature change nothing (the reference below is at temperature 1), and are named
           "trainer.loss_params.rho=4.0", "rollout.temperature=0.7"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (notice,) = [line for line in proc.stderr.splitlines() if line.startswith("megarl sft: not read")]
    named = notice.split(": ", 2)[2].split(", ")
    assert {"trainer.loss_params", "rollout.temperature", "run.steps", "data.train"} <= set(named)
    assert not any(k.startswith(("model.", "optimizer.", "run.output_dir")) for k in named), named
    summary = json.loads((out / "summary.json").read_text())
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert summary["steps"] == 4 and [m["epoch"] for m in metrics] == [1, 2, 3, 4]
    assert (out / "checkpoints" / "iter_0000004").is_dir()
    # the checkpoint is an RL run's model.source
    prep = subprocess.run([sys.executable, "-m", "megarl.cli", "train", "--config", str(ROOT / "configs" / "tiny_cpu.yaml"),
                           "--prepare-only", f"model.source={out / 'checkpoints'}", f"run.output_dir={tmp_path / 'rl'}"],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert prep.returncode == 0 and json.loads(prep.stdout.splitlines()[-1])["prepared"] == str(out / "checkpoints")

    # the reference: transformers' model on the same weights, each record's response tokens after its
    # chat-template prompt, their mean -log p (one batch holds every record at step 1)
    tok = AutoTokenizer.from_pretrained(tmp_path / "cache" / "smollm2-tokenizer")
    model = LlamaForCausalLM.from_pretrained(hf, torch_dtype=torch.float64).eval()
    nll, count = 0.0, 0
    for r in records:
        prompt = tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], tokenize=False,
                                         add_generation_prompt=True)  # fmt: skip
        p_ids = tok.encode(prompt, add_special_tokens=False)
        r_ids = tok.encode(r["response"] + "<|im_end|>\n", add_special_tokens=False)
        ids = torch.tensor([p_ids + r_ids])
        with torch.no_grad():
            logp = model(ids).logits[0].log_softmax(-1)
        for j, t in enumerate(r_ids):
            nll -= logp[len(p_ids) + j - 1, t].item()
        count += len(r_ids)
    assert metrics[0]["response_tokens"] == count  # the responses alone are trained, never the prompts
    assert metrics[0]["loss"] == pytest.approx(nll / count, rel=1e-4)
    # it learns the records: the loss falls every epoch, and by more than a tenth in four
    losses = summary["losses"]
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < 0.9 * losses[0], losses
