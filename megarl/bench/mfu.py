"""Model FLOPs of an RL train step, and the MFU they give: pure arithmetic (no torch), so a hand
count in the tests checks it and every GPU check reports the same figure.

Counted (model FLOPs, what the model needs, not what the kernels happen to do):

- per token, every weight matmul of every layer: QKV, the output projection, the MLP's gate, up
  and down (a dense layer), or a MoE layer's router and the top-k experts one token goes through;
  2 FLOPs per multiply-add in the forward, twice that in the backward (input and weight
  gradients): 6 x the multiply-adds for forward + backward;
- per sequence, core attention: Q K^T and P V, causal (query t attends to t + 1 keys), per layer
  and head, 2 x 2 x head_dim x L (L + 1) / 2 forward, 3 x that with the backward;
- the logits layer (hidden x vocab) on the positions whose log-probability the loss reads (the
  trainer runs the output layer on those alone: trainer/response_logits.py), 6 x as above.

Not counted: the input embedding (a lookup, no matmul), norms, RoPE, softmaxes, the loss and the
optimizer. The older formula (6 x all parameters x tokens) counted the input embedding's
vocab x hidden parameters as if each token multiplied them, and the logits layer at every
position: both overstate the work of a Llama with a 128k vocabulary.
"""

from __future__ import annotations

from typing import Iterable, Optional, Tuple

# bf16 dense tensor-core peaks from the vendors' datasheets (without sparsity), by a substring of
# torch.cuda.get_device_name(); the first match wins, so the more specific names come first
DATASHEET_BF16_FLOPS = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),  # SXM
    ("H200", 989e12),
    ("H20", 148e12),
    ("GH200", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("L40S", 362e12),
)


def datasheet_peak(device_name: str) -> Optional[float]:
    """The datasheet's bf16 FLOP/s of a device named ``device_name``, None if not in the table."""
    for key, flops in DATASHEET_BF16_FLOPS:
        if key in device_name:
            return flops
    return None


def layer_matmul_macs_per_token(spec) -> int:
    """Multiply-adds of the weight matmuls of all layers for one token (logits layer excluded)."""
    h, d = spec.hidden_size, spec.head_dim
    attention = h * (spec.num_attention_heads + 2 * spec.num_kv_heads) * d + spec.num_attention_heads * d * h
    dense_mlp = 3 * h * spec.ffn_hidden_size
    total = spec.num_layers * attention + spec.num_dense_layers * dense_mlp
    if spec.moe is not None:
        m = spec.moe
        router = h * m.num_experts
        experts = m.top_k * 3 * h * m.ffn_hidden_size + 3 * h * m.shared_expert_ffn_hidden_size
        total += spec.num_moe_layers * (router + experts)
    return total


def causal_attention_macs(spec, length: int) -> int:
    """Multiply-adds of core attention (Q K^T and P V) over one causal sequence, all layers."""
    pairs = length * (length + 1) // 2
    return 2 * spec.num_layers * spec.num_attention_heads * spec.head_dim * pairs


def train_step_flops(spec, sequences: Iterable[Tuple[int, int]]) -> float:
    """Forward + backward model FLOPs of one train step over ``sequences``: (tokens, logit
    positions) per sequence (each attends only within itself, as the trainer's packed rows do)."""
    per_token = layer_matmul_macs_per_token(spec)
    logits = spec.hidden_size * spec.vocab_size
    macs = 0
    for tokens, logit_positions in sequences:
        macs += tokens * per_token + causal_attention_macs(spec, tokens) + logit_positions * logits
    return 6.0 * macs


def mfu(flops: float, seconds: float, peak_flops: Optional[float]) -> Optional[float]:
    """The fraction of ``peak_flops`` that ``flops`` in ``seconds`` are; None without a peak."""
    if not peak_flops or not seconds:
        return None
    return flops / seconds / peak_flops
