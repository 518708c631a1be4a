"""A fixed RL batch for the tiny Llama, and an independent reference on transformers.

The reference is plain PyTorch on transformers' LlamaForCausalLM: one sample at
a time, log_softmax over the full (unpadded) vocabulary, each loss written out
from its definition (per token or per sequence) over the tokens the sample's
loss_mask trains, then aggregated as its mode defines (token mean over the batch,
or a mean over the sequences that have a trained token). It shares no code with
megarl's trainer.

CASES are the loss configurations the Megatron workers run (TrainerConfig fields,
bound by ``bound_loss``; ``masked``: on ``masked_samples`` of the batch);
``reference_grads`` reads the same dictionaries but implements every loss itself.
"""

from dataclasses import asdict, replace

import torch

from megarl.rollout import MASKED_LOGPROB, MASKED_VERSION, Sample, sample_from_dict

TEMPERATURE = 0.8
RHO = 4.0
PROMPT_LENGTHS = [3, 5, 7, 9, 4, 6, 8, 10]
POSITIONS = 16  # every sample spans 16 positions, so budgets 128/64/32 give 1/2/4 micro-batches
REWARDS = [1.0, 0.0, 0.5, 0.0, 0.0, 0.0, 1.0, 1.0]
GROUPS = [0, 0, 0, 0, 1, 1, 1, 1]
VERSION = 3  # the trainer's version: tokens of versions 1, 2, 3 have lags 2, 1, 0
MAX_NEW_TOKENS = 16  # Dr.GRPO's constant normaliser
MAX_LAG = 2  # the lag bound: buckets 0..2

# name -> TrainerConfig fields (the rollout section gives temperature and max_new_tokens), and
# ``masked``: run on masked_samples(batch)
CASES = {
    "aipo": dict(loss="aipo", loss_params={"rho": RHO}),
    "gspo": dict(loss="gspo", loss_params={"eps": 0.1, "eps_high": 0.15}),  # its own seq_mean_token_mean
    "aipo_seq": dict(
        loss="aipo",
        loss_params={"rho": 1.2, "is_level": "sequence", "mask_c": 3.0},
        loss_agg="seq_mean_token_sum",
        entropy_coef=0.05,
    ),
    "ppo_mis": dict(
        loss="ppo_clip",
        loss_params={"eps": 0.2, "eps_high": 0.28, "mask_c": 1.25, "mask_level": "sequence"},
        loss_agg="seq_mean_token_mean",
    ),
    "dr_grpo": dict(loss="dr_grpo", loss_params={}),  # its own seq_mean_token_sum_norm
    "gmpo": dict(loss="examples.losses.gmpo:gmpo", loss_params={"eps_low": 0.2}),  # a user loss, seq_mean_token_mean
    # the loss mask: token-level, a sequence ratio over the trained tokens, and sequence-level IS with
    # the entropy bonus summed per sequence
    "aipo_masked": dict(loss="aipo", loss_params={"rho": RHO}, masked=True),
    "gspo_masked": dict(loss="gspo", loss_params={"eps": 0.1, "eps_high": 0.15}, masked=True),
    "aipo_seq_masked": dict(
        loss="aipo",
        loss_params={"rho": 1.2, "is_level": "sequence", "mask_c": 3.0},
        loss_agg="seq_mean_token_sum",
        entropy_coef=0.05,
        masked=True,
    ),
}

# masked_samples: per sample, which response tokens the loss leaves out (None: none). Sample 1 every other
# token (half), sample 2 its first half, sample 6 its second half, sample 5 every token (it counts in
# group 1's baseline, but adds nothing to the loss or to the sequence count)
MASKS = {1: lambda j, n: j % 2 == 1, 2: lambda j, n: j < n // 2, 5: lambda j, n: True, 6: lambda j, n: j >= n // 2}


def masked_samples(samples):
    """``samples`` with MASKS applied: loss_mask 0 there, and the placeholders a masked token carries
    (NaN behaviour log-prob, version -1) in place of its real values, which nothing may read."""
    out = []
    for i, s in enumerate(samples):
        off = MASKS.get(i)
        n = len(s.response_tokens)
        mask = [0 if off is not None and off(j, n) else 1 for j in range(n)]
        out.append(
            replace(
                s,
                loss_mask=mask,
                behaviour_logprobs=[mu if m else MASKED_LOGPROB for mu, m in zip(s.behaviour_logprobs, mask)],
                policy_versions=[v if m else MASKED_VERSION for v, m in zip(s.policy_versions, mask)],
                trainer_logprobs=None,
            )
        )
    return out


def case_samples(samples, case):
    return masked_samples(samples) if case.get("masked") else samples


def bound_loss(case, lag_bound=MAX_LAG):
    """``case`` bound as the trainer binds a config's loss."""
    from megarl.config import RolloutConfig, TrainerConfig
    from megarl.trainer.bound_loss import bind_loss

    trainer = TrainerConfig(**{k: v for k, v in case.items() if k != "masked"})
    return bind_loss(trainer, RolloutConfig(temperature=TEMPERATURE, max_new_tokens=MAX_NEW_TOKENS), lag_bound)


def response_logprobs(model, prompt, response, temperature, entropy=False):
    tokens = torch.tensor([prompt + response])
    logits = model(tokens).logits[0, :-1].float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    positions = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(response))
    picked = logp[positions, torch.tensor(response)]
    if not entropy:
        return picked
    return picked, -(logp[positions].exp() * logp[positions]).sum(-1)


def make_samples(hf_dir, vocab_size: int, seed: int = 11):
    """Samples whose behaviour log-probs are the model's own, perturbed (some ratios exceed rho),
    produced by policy versions 1..3 (lags 0..2 against VERSION)."""
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
        # an in-flight update mid-sequence: the first i % 3 tokens by version 1, the next two by 2
        cut = i % 3
        versions = [1] * cut + [2] * 2 + [3] * (len(response) - cut - 2)
        samples.append(Sample(prompt, response, mu, versions, REWARDS[i], GROUPS[i]))
    return samples


def with_random_routes(samples, hf_dir, seed: int = 5):
    """Copies of ``samples`` carrying routed experts as a generator records them ([positions,
    num_layers, top_k] int16, -1 on dense layers), drawn at random: not the experts the model's own
    routers choose, so a trainer that ignores them routes (and differentiates) differently."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(hf_dir)
    g = torch.Generator().manual_seed(seed)
    out = []
    for sample in samples:
        routes = torch.full((len(sample), config.num_hidden_layers, config.num_experts_per_tok), -1, dtype=torch.int16)
        for layer in range(config.num_hidden_layers):
            if layer in config.mlp_only_layers:
                continue
            for position in range(len(sample)):
                experts = torch.randperm(config.num_experts, generator=g)[: config.num_experts_per_tok]
                routes[position, layer] = experts.to(torch.int16)
        out.append(replace(sample, routed_experts=routes))
    return out


class forced_routes:
    """transformers' Qwen3-MoE routers take the given experts ([positions, num_layers, top_k]; a
    position beyond them, or -1, keeps its own top-k) for one sample's forward: the reference of
    routing replay, written on transformers' own router (its softmax, gather and renormalisation)."""

    def __init__(self, model, routes):
        self.model, self.routes = model, routes

    def __enter__(self):
        self.saved = []
        for index, layer in enumerate(self.model.model.layers):
            gate = getattr(layer.mlp, "gate", None)
            if gate is None or not hasattr(gate, "top_k"):
                continue
            self.saved.append((gate, gate.forward))
            gate.forward = self._forced(gate, self.routes[:, index].long())
        return self

    def __exit__(self, *exc):
        for gate, forward in self.saved:
            gate.forward = forward

    @staticmethod
    def _forced(gate, routes):
        def forward(hidden_states):
            hidden_states = hidden_states.reshape(-1, gate.hidden_dim)
            logits = torch.nn.functional.linear(hidden_states, gate.weight)
            probs = torch.softmax(logits, dtype=torch.float, dim=-1)
            _, own = torch.topk(probs, gate.top_k, dim=-1)
            n = min(len(routes), len(own))
            forced = own.clone()
            given = routes[:n, 0] >= 0
            forced[:n][given] = routes[:n][given]
            values = probs.gather(1, forced)
            if gate.norm_topk_prob:
                values = values / values.sum(dim=-1, keepdim=True)
            return logits, values.to(logits.dtype), forced

        return forward


def save_samples(samples, path):
    torch.save([asdict(s) for s in samples], path)


def load_samples(path):
    return [sample_from_dict(d) for d in torch.load(path)]


def group_mean_advantages(samples):
    out = []
    for s in samples:
        group = [t.reward for t in samples if t.group_id == s.group_id]
        out.append(s.reward - sum(group) / len(group))
    return out


def _clip(x, low, high):
    return torch.minimum(torch.maximum(x, torch.tensor(low)), torch.tensor(high))


def _sequence_terms(case, logp, mu, adv, entropy):
    """(per-token loss [T] or per-sequence loss (scalar), which) from the loss's definition."""
    p = case["loss_params"]
    name = case["loss"]
    log_r = logp - mu
    if name == "aipo":
        lr = log_r.detach()
        if p.get("is_level") == "sequence":
            lr = lr.mean().expand_as(lr)
        loss = -torch.exp(lr).clamp(max=p["rho"]) * adv * logp
    elif name in ("ppo_clip", "dr_grpo"):
        eps = p.get("eps", 0.2)
        high = p.get("eps_high", eps)
        r = log_r.exp()
        loss = -torch.minimum(r * adv, _clip(r, 1 - eps, 1 + high) * adv)
    elif name == "gspo":
        s = log_r.mean().exp()
        return -torch.minimum(s * adv, _clip(s, 1 - p["eps"], 1 + p["eps_high"]) * adv), "sequence"
    elif name.endswith(":gmpo"):
        low, high = p["eps_low"], p.get("eps_high", 0.4)
        clipped = _clip(log_r, -low, high)
        chosen = torch.minimum(log_r, clipped) if adv > 0 else torch.maximum(log_r, clipped)
        return -adv * chosen.mean().exp(), "sequence"
    else:
        raise ValueError(name)
    if p.get("mask_c"):
        lr = log_r.detach()
        if p.get("mask_level") == "sequence":
            lr = lr.mean().expand_as(lr)
        loss = loss * (lr.abs() <= torch.log(torch.tensor(p["mask_c"]))).float()
    return loss - case.get("entropy_coef", 0.0) * entropy, "token"


def _aggregation(case):
    name = case["loss"]
    if case.get("loss_agg"):
        return case["loss_agg"]
    return {"gspo": "seq_mean_token_mean", "dr_grpo": "seq_mean_token_sum_norm"}.get(
        name, "seq_mean_token_mean" if name.endswith(":gmpo") else "token_mean"
    )


# Megatron's MoE auxiliary losses as the gradient tests turn them on (TrainerConfig fields): large
# enough that leaving them out of the reference moves the gradient far past the tests' bound
MOE_AUX = dict(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)


def moe_router_terms(model, samples, micro_batches, top_k: int):
    """Megatron's per-layer, per-micro-batch router losses written out on transformers' model:
    for each micro-batch (the sample indices it packs, every position of each sample routed) and
    each MoE layer, (Switch load-balancing loss / coeff, z-loss / coeff, routed positions T):

        lb = E / (k T^2) sum_i (sum_x p_x,i) (sum_x [i in top-k(p_x)]),  p_x = softmax(router logits_x)
        z  = (1 / T) sum_x logsumexp(router logits_x)^2

    (Switch Transformer eq. 4 with Megatron's k normaliser; ST-MoE eq. 5). Differentiable."""
    out = []
    for indices in micro_batches:
        logits = None
        for i in indices:
            s = samples[i]
            tokens = torch.tensor([(s.prompt_tokens + s.response_tokens)[:-1]])  # the positions it spans
            layers = model(tokens, output_router_logits=True).router_logits
            rows = [layer.float() for layer in layers]
            logits = rows if logits is None else [torch.cat([a, b]) for a, b in zip(logits, rows)]
        terms = []
        for layer_logits in logits:
            positions, experts = layer_logits.shape
            probs = torch.softmax(layer_logits, dim=-1)
            chosen = torch.zeros_like(probs).scatter(1, probs.topk(top_k, dim=-1).indices, 1.0)
            lb = experts / (top_k * positions**2) * (probs.sum(0) * chosen.sum(0)).sum()
            z = (torch.logsumexp(layer_logits, dim=-1) ** 2).mean()
            terms.append((lb, z, positions))
        out.append(terms)
    return out


def reference_grads(hf_dir, samples, case=CASES["aipo"], moe_micro_batches=None, sensitivity=False):
    """(HF-named gradients, the loss's value) of ``case`` over the trained tokens of ``samples``
    (``case_samples``: masked ones for a masked case); a masked token is context, never a loss term.
    ``sensitivity``: a third value, sum_t |dL/d log p_t| + |dL/dH_t| (1 + H_t) over the response
    tokens (H_t the entropy): how far the loss moves, to first order, when every log-prob of the
    vocabulary moves by at most 1 (the entropy then by at most 1 + H_t)
    ``moe_micro_batches`` (the sample indices of every micro-batch on every DP rank): MOE_AUX's router
    losses added as Megatron adds them with a per-token loss -- each micro-batch's and layer's loss
    times its routed positions, over the step's trained tokens."""
    from transformers import AutoModelForCausalLM

    samples = case_samples(samples, case)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    agg = _aggregation(case)
    kept = [[j for j, m in enumerate(s.loss_mask) if m] for s in samples]
    total_tokens = sum(len(k) for k in kept)
    sequences = sum(1 for k in kept if k)  # a sample with every token masked is not one of them
    loss = torch.zeros(())
    watched = []  # (log p, entropy) of each sample's response, for ``sensitivity``
    # the baseline is over every sample of a group, trained or not
    for s, adv, k in zip(samples, group_mean_advantages(samples), kept):
        if not k:
            continue
        if s.routed_experts is not None:  # routing replay's reference: the recorded experts
            with forced_routes(model, s.routed_experts):
                logp, entropy = response_logprobs(model, s.prompt_tokens, s.response_tokens, TEMPERATURE, entropy=True)
        else:
            logp, entropy = response_logprobs(model, s.prompt_tokens, s.response_tokens, TEMPERATURE, entropy=True)
        if sensitivity:
            logp.retain_grad()
            entropy.retain_grad()
            watched.append((logp, entropy))
        k = torch.tensor(k)
        mu = torch.tensor(s.behaviour_logprobs)[k]
        terms, kind = _sequence_terms(case, logp[k], mu, adv, entropy[k])
        if kind == "sequence":  # the sequence's loss, the same for each of its tokens
            assert agg == "seq_mean_token_mean"
            loss = loss + terms / sequences
        elif agg == "token_mean":
            loss = loss + terms.sum() / total_tokens
        elif agg == "seq_mean_token_mean":
            loss = loss + terms.mean() / sequences
        elif agg == "seq_mean_token_sum":
            loss = loss + terms.sum() / sequences
        else:  # seq_mean_token_sum_norm
            loss = loss + terms.sum() / MAX_NEW_TOKENS / sequences
    if moe_micro_batches is not None:
        top_k = model.config.num_experts_per_tok
        for terms in moe_router_terms(model, samples, moe_micro_batches, top_k):
            for lb, z, positions in terms:
                aux = MOE_AUX["moe_aux_loss_coeff"] * lb + MOE_AUX["moe_z_loss_coeff"] * z
                loss = loss + aux * positions / total_tokens
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    if not sensitivity:
        return grads, loss.item()
    moved = 0.0
    for logp, entropy in watched:
        moved += logp.grad.abs().sum().item()
        if entropy.grad is not None:  # the sequence-level losses leave the entropy out
            moved += (entropy.grad.abs() * (1 + entropy.detach())).sum().item()
    return grads, loss.item(), moved


def reference_aipo_grads(hf_dir, samples):
    return reference_grads(hf_dir, samples, CASES["aipo"])


def reference_entropy_mean(hf_dir, samples):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ent = [
            response_logprobs(model, s.prompt_tokens, s.response_tokens, TEMPERATURE, entropy=True)[1] for s in samples
        ]
    return torch.cat(ent).mean().item()
