"""Pack variable-length samples into Megatron micro-batches without padding waste.

Each optimizer step's samples are split over the data-parallel ranks (balanced
by token count), then packed first-fit-decreasing into rows of at most
``max_tokens`` positions: one row is one micro-batch (micro_batch_size 1), and
several samples share it without attending to each other.

- With Transformer Engine the row is Megatron's packed ``thd`` format
  (PackedSeqParams with cu_seqlens): attention and RoPE restart per sample.
- With Megatron's local layer spec (CPU) the row carries a block-diagonal
  causal attention mask instead. RoPE then sees each sample at an offset
  within the row; attention scores under RoPE depend only on the distance
  between positions, so this is the same function (up to float rounding).

Every rank builds the plan of every DP rank from the full batch (identical on
all ranks, no communication), so all ranks agree on the number of
micro-batches; DP ranks with fewer bins get empty rows (loss mask 0). With
pipeline parallelism rows are padded to ``max_tokens`` (the schedule sends
fixed-shape activations); without it they are exactly as long as their samples.
Packing efficiency = real tokens / row positions processed.

A sample never straddles micro-batches (bins hold whole samples), so a loss can
reduce over a sample's tokens within one micro-batch; each micro-batch also
carries the step's totals of samples and trained tokens (over every DP rank),
which sequence-level aggregations need for an exact global normaliser.

The row's loss mask is the samples' ``loss_mask``: a masked response token is
packed (it is context for the tokens after it) but off the mask, so the loss, its
normalisers and the metrics never see it (megarl.trainer.aggregation).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from megarl.errors import ConfigError
from megarl.rollout import Sample


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [1, L]
    position_ids: torch.Tensor  # [1, L], restarting at 0 for each sample
    targets: torch.Tensor  # [1, L] next token at each position
    loss_mask: torch.Tensor  # [1, L] 1.0 where the target is a trained response token (Sample.loss_mask 1)
    behaviour_logprobs: torch.Tensor  # [1, L] log mu of the target (0 off the mask)
    advantages: torch.Tensor  # [1, L]
    policy_versions: torch.Tensor  # [1, L] (-1 off the mask)
    sample_ids: torch.Tensor  # [1, L] the target's sample, 0..n-1 in this micro-batch (-1 off the mask)
    lags: torch.Tensor  # [1, L] trainer version - token version (0 off the mask)
    response_lengths: torch.Tensor  # [n] trained tokens of each sample, in sample_indices order
    group_ids: torch.Tensor  # [n]
    attention_mask: Optional[torch.Tensor]  # [1, 1, L, L] True = masked (local spec)
    packed_seq_params: Optional[object]  # megatron PackedSeqParams (TE spec)
    sample_indices: List[int]
    real_tokens: int
    ref_logprobs: Optional[torch.Tensor] = None  # [1, L], filled by a reference-model pass
    step_sequences: int = 0  # samples with a trained token in the whole step (all micro-batches, all DP ranks)
    step_tokens: int = 0  # trained tokens in the whole step
    trainer_logprobs: Optional[torch.Tensor] = None  # log pi of the trained tokens in row order, left by the hook
    # [L, num_layers, top_k] int16: the generator's routed experts of each position (-1: none recorded,
    # padding, dense layers); None when no sample of the row carries them (trainer/router_replay.py)
    routes: Optional[torch.Tensor] = None

    @property
    def length(self) -> int:
        return self.input_ids.shape[1]


def newest_version(samples: Sequence[Sample]) -> int:
    """The newest policy version among the trained tokens of ``samples`` (0 when none is trained)."""
    return max((v for s in samples for v in s.trained(s.policy_versions)), default=0)


def split_across_dp(lengths: Sequence[int], dp_size: int) -> List[List[int]]:
    """Sample indices per DP rank, longest first to the least-loaded rank."""
    loads = [0] * dp_size
    parts: List[List[int]] = [[] for _ in range(dp_size)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        rank = min(range(dp_size), key=lambda r: (loads[r], r))
        parts[rank].append(i)
        loads[rank] += lengths[i]
    return parts


def first_fit_decreasing(indices: Sequence[int], lengths: Sequence[int], capacity: int) -> List[List[int]]:
    bins: List[List[int]] = []
    room: List[int] = []
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(capacity - lengths[i])
    return bins


def _segments_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """Causal within a segment, nothing across segments; True = masked (Megatron's convention)."""
    same = segment_ids[:, None] == segment_ids[None, :]
    causal = torch.ones(len(segment_ids), len(segment_ids), dtype=torch.bool).tril()
    return ~(same & causal)[None, None]


def _packed_seq_params(seq_lengths: List[int]):
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0] + seq_lengths, dtype=torch.int32).cumsum(0).to(torch.int32)
    longest = max(seq_lengths)
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest
    )


def build_micro_batch(
    samples: Sequence[Sample],
    advantages: Sequence[float],
    indices: Sequence[int],
    row_length: int,
    thd: bool,
    version: Optional[int] = None,
) -> MicroBatch:
    """``version``: the trainer's, for each token's lag (default: the newest trained token's version among
    ``indices``). A response token whose loss_mask is 0 is in the row (the model reads it) but off its
    mask, with 0 / -1 in the per-token rows: its placeholder log mu (NaN) and version never enter a tensor."""
    if version is None:
        version = newest_version([samples[i] for i in indices])
    ids, pos, tgt, mask, mu, adv, ver, seg, sid, lag = ([] for _ in range(10))
    for segment, i in enumerate(indices):
        s = samples[i]
        tokens = list(s.prompt_tokens) + list(s.response_tokens)
        n, p = len(tokens) - 1, len(s.prompt_tokens)
        ids += tokens[:-1]
        tgt += tokens[1:]
        pos += range(n)
        seg += [segment] * n
        # position t predicts tokens[t + 1]; response token j sits at t = p - 1 + j
        off = p - 1
        trained = [bool(m) for m in s.loss_mask]
        mask += [0.0] * off + [1.0 if m else 0.0 for m in trained]
        mu += [0.0] * off + [float(x) if m else 0.0 for x, m in zip(s.behaviour_logprobs, trained)]
        adv += [0.0] * off + [float(advantages[i]) if m else 0.0 for m in trained]
        ver += [-1] * off + [int(v) if m else -1 for v, m in zip(s.policy_versions, trained)]
        sid += [-1] * off + [segment if m else -1 for m in trained]
        lag += [0] * off + [version - int(v) if m else 0 for v, m in zip(s.policy_versions, trained)]
    real = len(ids)
    pad = row_length - real
    seq_lengths = [len(samples[i]) for i in indices] + ([pad] if pad else [])
    seg += [len(indices)] * pad
    ids, tgt, pos = ids + [0] * pad, tgt + [0] * pad, pos + list(range(pad))
    mask, mu, adv, ver = mask + [0.0] * pad, mu + [0.0] * pad, adv + [0.0] * pad, ver + [-1] * pad
    sid, lag = sid + [-1] * pad, lag + [0] * pad

    def row(values, dtype):
        return torch.tensor(values, dtype=dtype).unsqueeze(0)

    routes = _packed_routes([samples[i] for i in indices], row_length)

    return MicroBatch(
        input_ids=row(ids, torch.long),
        position_ids=row(pos, torch.long),
        targets=row(tgt, torch.long),
        loss_mask=row(mask, torch.float32),
        behaviour_logprobs=row(mu, torch.float32),
        advantages=row(adv, torch.float32),
        policy_versions=row(ver, torch.long),
        sample_ids=row(sid, torch.long),
        lags=row(lag, torch.long),
        response_lengths=torch.tensor([samples[i].trained_tokens for i in indices], dtype=torch.long),
        group_ids=torch.tensor([samples[i].group_id for i in indices], dtype=torch.long),
        attention_mask=None if thd else _segments_mask(torch.tensor(seg)),
        packed_seq_params=_packed_seq_params(seq_lengths) if thd and seq_lengths else None,
        sample_indices=list(indices),
        real_tokens=real,
        routes=routes,
    )


def _packed_routes(samples: Sequence[Sample], row_length: int) -> Optional[torch.Tensor]:
    """The samples' routed experts laid end to end as their positions are in the row (-1 where a
    sample has none, and on padding)."""
    recorded = [s.routed_experts for s in samples if s.routed_experts is not None]
    if not recorded:
        return None
    routes = torch.full((row_length, *recorded[0].shape[1:]), -1, dtype=torch.int16)
    start = 0
    for s in samples:
        if s.routed_experts is not None:
            routes[start : start + len(s)] = torch.as_tensor(s.routed_experts, dtype=torch.int16)
        start += len(s)
    return routes


@dataclass
class PackingPlan:
    micro_batches: List[MicroBatch]  # this DP rank's
    seq_length: int  # the row length Megatron's schedule is told (max over rows)
    efficiency: float  # real tokens / positions processed, over all DP ranks


def plan_micro_batches(
    samples: Sequence[Sample],
    advantages: Sequence[float],
    dp_rank: int,
    dp_size: int,
    max_tokens: int,
    fixed_row_length: bool,
    thd: bool,
    count_multiple: int = 1,
    row_multiple: int = 1,
    version: Optional[int] = None,
) -> PackingPlan:
    """This DP rank's micro-batches. ``fixed_row_length``: pad every row to max_tokens (PP > 1).
    ``row_multiple``: pad every row to a multiple of it (sequence parallelism splits rows over TP).
    ``version``: the trainer's policy version, for the lags (default: the batch's newest token version)."""
    lengths = [len(s) for s in samples]
    for i, n in enumerate(lengths):
        if n > max_tokens:
            raise ConfigError(
                f"sample {i} spans {n} positions (prompt {len(samples[i].prompt_tokens)} + response "
                f"{len(samples[i].response_tokens)} - 1), more than max_tokens_per_microbatch={max_tokens}"
            )
    bins_per_rank = [first_fit_decreasing(part, lengths, max_tokens) for part in split_across_dp(lengths, dp_size)]
    count = max(len(bins) for bins in bins_per_rank)
    count = -(-max(count, 1) // count_multiple) * count_multiple
    row_lengths = [
        [
            max_tokens if fixed_row_length else -(-sum(lengths[i] for i in b) // row_multiple) * row_multiple
            for b in bins
        ]
        for bins in bins_per_rank
    ]
    empty_row = max_tokens if fixed_row_length else row_multiple
    processed = sum(sum(r) + (count - len(r)) * empty_row for r in row_lengths)
    if version is None:
        version = newest_version(samples)
    mine = bins_per_rank[dp_rank]
    micro_batches = [
        build_micro_batch(samples, advantages, b, n, thd, version) for b, n in zip(mine, row_lengths[dp_rank])
    ]
    while len(micro_batches) < count:
        micro_batches.append(build_micro_batch(samples, advantages, [], empty_row, thd, version))
    # the normalisers count what is trained: a sample with every token masked adds to neither
    step_tokens = sum(s.trained_tokens for s in samples)
    step_sequences = sum(1 for s in samples if s.trained_tokens)
    for mb in micro_batches:  # every DP rank plans every rank's bins: these are global totals
        mb.step_sequences, mb.step_tokens = step_sequences, step_tokens
    return PackingPlan(
        micro_batches=micro_batches,
        seq_length=max(mb.length for mb in micro_batches),
        efficiency=sum(lengths) / processed if processed else 0.0,
    )
