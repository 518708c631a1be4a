"""A fixed RL batch for the tiny Llama, and an independent AIPO reference on transformers.

The reference is plain PyTorch on transformers' LlamaForCausalLM: one sample at
a time, log_softmax over the full (unpadded) vocabulary, the AIPO formula
written out, normalised by the number of response tokens in the batch. It
shares no code with megarl's trainer.
"""

from dataclasses import asdict

import torch

from megarl.rollout import Sample

TEMPERATURE = 0.8
RHO = 4.0
PROMPT_LENGTHS = [3, 5, 7, 9, 4, 6, 8, 10]
POSITIONS = 16  # every sample spans 16 positions, so budgets 128/64/32 give 1/2/4 micro-batches
REWARDS = [1.0, 0.0, 0.5, 0.0, 0.0, 0.0, 1.0, 1.0]
GROUPS = [0, 0, 0, 0, 1, 1, 1, 1]


def response_logprobs(model, prompt, response, temperature):
    tokens = torch.tensor([prompt + response])
    logits = model(tokens).logits[0, :-1].float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    positions = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(response))
    return logp[positions, torch.tensor(response)]


def make_samples(hf_dir, vocab_size: int, seed: int = 11):
    """Samples whose behaviour log-probs are the model's own, perturbed (some ratios exceed rho)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i, p in enumerate(PROMPT_LENGTHS):
        tokens = torch.randint(0, vocab_size, (POSITIONS + 1,), generator=g).tolist()
        prompt, response = tokens[:p], tokens[p:]
        with torch.no_grad():
            logp = response_logprobs(model, prompt, response, TEMPERATURE)
        noise = torch.randn(len(response), generator=g)
        noise[0] = -5.0 if i == 0 else noise[0]  # one token far above rho
        mu = (logp + noise).tolist()
        samples.append(Sample(prompt, response, mu, [3] * len(response), REWARDS[i], GROUPS[i]))
    return samples


def save_samples(samples, path):
    torch.save([asdict(s) for s in samples], path)


def load_samples(path):
    return [Sample(**d) for d in torch.load(path)]


def group_mean_advantages(samples):
    out = []
    for s in samples:
        group = [t.reward for t in samples if t.group_id == s.group_id]
        out.append(s.reward - sum(group) / len(group))
    return out


def reference_aipo_grads(hf_dir, samples):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    total_tokens = sum(len(s.response_tokens) for s in samples)
    loss = torch.zeros(())
    for s, adv in zip(samples, group_mean_advantages(samples)):
        logp = response_logprobs(model, s.prompt_tokens, s.response_tokens, TEMPERATURE)
        weight = torch.exp(logp.detach() - torch.tensor(s.behaviour_logprobs)).clamp(max=RHO)
        loss = loss - (weight * adv * logp).sum()
    (loss / total_tokens).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}, (loss / total_tokens).item()
