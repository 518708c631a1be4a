"""One RL optimizer step on Megatron-Core: rollouts in, updated policy and metrics out.

    [overlong: penalise or leave out samples cut by max_new_tokens]
    -> advantages (group baseline / RLOO)  ->  pack into micro-batches per DP rank
    -> [reference model log-probs, if a KL penalty is configured]
    -> Megatron's forward_backward_func with the loss hook
    -> non-finite guard  ->  optimizer step (gradient clipping inside)

Every rank of the trainer calls ``step`` with the same list of samples; each
rank picks its own DP shard. The returned metrics are identical on every rank.
``step(samples, version)``: the trainer's policy version gives each token's lag
(trainer version - token version) for the loss and the per-lag mismatch metrics.
Each trained sample gets ``trainer_logprobs``: log pi of its response
tokens as the loss saw them (gathered from the last pipeline stage of every DP
rank), None at a token its loss_mask leaves out, so a run's log holds both sides
of every importance ratio. A sample the loss leaves out whole (overlong=mask, or
every token masked) keeps trainer_logprobs None.

``loss`` is the trainer's BoundLoss (megarl.trainer.bound_loss): the function,
its parameters, its aggregation and settings, resolved once when the trainer is
built.
"""

from __future__ import annotations

import logging
import math
import time
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu

from megarl.models.megatron_model import transformer_engine_usable
from megarl.rollout import Sample, episode_metrics, validate_samples
from megarl.trainer.advantages import compute_advantages
from megarl.trainer.aggregation import sample_overlong_penalty
from megarl.trainer.bound_loss import BoundLoss
from megarl.trainer.hooks import make_forward_step, make_logprob_collector
from megarl.trainer.moe_losses import moe_loss_metrics
from megarl.trainer.packing import MicroBatch, PackingPlan, plan_micro_batches
from megarl.trainer.setup import run_schedule, zero_grads
from megarl.trainer.stats import BASE_FIELDS, metrics_from_totals, stat_fields

logger = logging.getLogger(__name__)
RATIO_MAX = BASE_FIELDS.index("ratio_max")
TRUNCATED = "length"  # Sample.finish_reason of a sample cut by max_new_tokens


def shape_batch(samples: Sequence[Sample], loss: BoundLoss) -> Tuple[List[Sample], List[float], dict]:
    """(the samples the loss sees, their advantages, overlong metrics) under ``loss.overlong``.

    Advantages are computed over every sample of each group. Then the samples the loss
    trains nothing of are left out (of the loss and of the step's totals, so the
    normaliser counts only what is trained), their rewards still in their group's
    baseline: with overlong=mask, those cut by max_new_tokens (as DAPO's overlong
    filtering does); always, those whose every token is masked (loss_mask all 0).
    penalty: DAPO's soft overlong penalty added to each reward before the advantages; an episode's is
    its worst turn's, each turn against rollout.max_new_tokens (aggregation.sample_overlong_penalty).
    """
    validate_samples(samples)
    truncated = [s.finish_reason == TRUNCATED for s in samples]
    penalties = [0.0] * len(samples)
    if loss.overlong == "penalty":
        penalties = [sample_overlong_penalty(s, loss.max_new_tokens, loss.overlong_buffer) for s in samples]
    advantages = compute_advantages(
        samples,
        loss.advantage_estimator,
        loss.normalize_advantage_std,
        rewards=[float(s.reward) + p for s, p in zip(samples, penalties)],
    )
    overlong_masked = [t and loss.overlong == "mask" for t in truncated]
    keep = [i for i, s in enumerate(samples) if s.trained_tokens and not overlong_masked[i]]
    info = {
        "truncated_frac": sum(truncated) / len(samples),
        "overlong_masked": sum(overlong_masked),
        "overlong_penalty_mean": sum(penalties) / len(samples),
        **episode_metrics(samples),
    }
    return [samples[i] for i in keep], [advantages[i] for i in keep], info


def trained_logprobs_flat(samples: Sequence[Sample], micro_batches: Sequence[MicroBatch], flat) -> None:
    """Write each micro-batch's ``trainer_logprobs`` (its trained tokens, row order) into ``flat``: the
    step's trained tokens, sample by sample in ``samples`` order (the order ``per_sample_logprobs`` reads)."""
    offsets = [0]
    for s in samples:
        offsets.append(offsets[-1] + s.trained_tokens)
    for mb in micro_batches:
        if mb.trainer_logprobs is None:
            continue
        start = 0
        for i in mb.sample_indices:
            n = offsets[i + 1] - offsets[i]
            flat[offsets[i] : offsets[i + 1]] = mb.trainer_logprobs[start : start + n].float()
            start += n


def per_sample_logprobs(samples: Sequence[Sample], values: Sequence[float]) -> List[List[Optional[float]]]:
    """The flat trained-token values spread over each sample's response tokens: None where masked."""
    out, it = [], iter(values)
    for s in samples:
        out.append([next(it) if m else None for m in s.loss_mask])
    return out


class PolicyTrainer:
    def __init__(
        self,
        ddp_chunks: list,
        optimizer,
        vocab_size: int,
        loss: BoundLoss,
        max_tokens_per_microbatch: int,
        ref_chunks: Optional[list] = None,
        thd: Optional[bool] = None,
        lr_scheduler=None,
        routing=None,
    ):
        """``routing``: a RoutingReplay over ``ddp_chunks`` (models with experts: the generator's
        routes replayed, or with replay off only compared; trainer/router_replay.py)."""
        if loss.kl_coef and ref_chunks is None:
            raise ValueError("loss.kl_coef > 0 needs a reference model (ref_chunks)")
        self.ddp_chunks = ddp_chunks
        self.optimizer = optimizer
        self.vocab_size = vocab_size
        self.loss = loss
        self.stat_fields = stat_fields(loss.lag_bound)
        self.max_tokens = max_tokens_per_microbatch
        self.ref_chunks = ref_chunks
        self.lr_scheduler = lr_scheduler  # Megatron's OptimizerParamScheduler, stepped after each update
        self.routing = routing
        self.thd = transformer_engine_usable() if thd is None else thd

    # -- data ------------------------------------------------------------------------------

    def plan(self, samples: Sequence[Sample], version: Optional[int] = None) -> PackingPlan:
        """``samples`` as the loss sees them (``shape_batch``), packed for this rank."""
        kept, advantages, _ = shape_batch(samples, self.loss)
        return self._pack(kept, advantages, version)

    def _pack(self, samples: Sequence[Sample], advantages: Sequence[float], version: Optional[int]) -> PackingPlan:
        pp = mpu.get_pipeline_model_parallel_world_size()
        config = self.ddp_chunks[0].config
        vp = config.virtual_pipeline_model_parallel_size
        return plan_micro_batches(
            samples,
            advantages,
            mpu.get_data_parallel_rank(),
            mpu.get_data_parallel_world_size(),
            self.max_tokens,
            fixed_row_length=pp > 1,
            thd=self.thd,
            count_multiple=pp if vp else 1,
            row_multiple=mpu.get_tensor_model_parallel_world_size() if config.sequence_parallel else 1,
            version=version,
        )

    # -- the step ----------------------------------------------------------------------------

    def forward_backward(self, samples: Sequence[Sample], version: Optional[int] = None):
        """Gradients of the loss over ``samples`` in the DDP buffers; returns (plan, per-micro-batch stats).
        ``version``: the trainer's policy version (lags); default the batch's newest token version."""
        kept, advantages, self.overlong_info = shape_batch(samples, self.loss)
        self.positions_trained = sum(len(s) for s in kept)
        plan = self._pack(kept, advantages, version)
        if self.ref_chunks is not None:
            collector = make_logprob_collector(self.vocab_size, self.loss.temperature)
            with torch.no_grad():
                run_schedule(
                    self.ref_chunks,
                    collector,
                    plan.micro_batches,
                    plan.seq_length,
                    1,
                    forward_only=True,
                    collect_non_loss_data=True,
                )
        zero_grads(self.ddp_chunks, self.optimizer)
        if self.routing is not None:
            self.routing.begin_step(plan.micro_batches)
        try:
            outputs = run_schedule(
                self.ddp_chunks,
                make_forward_step(self.loss, self.vocab_size, self.routing),
                plan.micro_batches,
                plan.seq_length,
                1,
                forward_only=False,
            )
        finally:
            if self.routing is not None:
                self.routing.end_step()
        self._hand_back_logprobs(kept, plan)
        self.moe_metrics = moe_loss_metrics(self.ddp_chunks[0].config, len(plan.micro_batches), self._device())
        if self.routing is not None:
            self.moe_metrics.update(self.routing.step_metrics(self._device()))
        return plan, [o["stats"] for o in outputs]

    def step(self, samples: Sequence[Sample], version: Optional[int] = None) -> dict:
        start = time.perf_counter()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        self.lr_used = self.optimizer.param_groups[0]["lr"]
        plan, stats = self.forward_backward(samples, version)
        totals = self._reduce_stats(stats)
        reason = self._nonfinite_reason(totals)
        if reason is None:
            success, grad_norm, _ = self.optimizer.step()
            if not success:
                reason = "optimizer reported a non-finite gradient"
            elif self.ddp_chunks[0].ddp_config.overlap_param_gather:
                # The distributed optimizer would leave the updated shards to be all-gathered by the
                # next forward; the weight sync reads the parameters now, so gather them now.
                for chunk in self.ddp_chunks:
                    chunk.start_param_sync(force_sync=True)
            if reason is None and self.lr_scheduler is not None:
                self.lr_scheduler.step(1)  # as Megatron-LM: only after an update
        if reason is not None:
            grad_norm = float("nan")
            zero_grads(self.ddp_chunks, self.optimizer)
            logger.warning("optimizer step skipped, weights unchanged: %s", reason)
        elapsed = time.perf_counter() - start
        real_tokens = self.positions_trained  # overlong=mask: the masked samples were not processed
        return self._metrics(totals, grad_norm, reason, plan, elapsed, real_tokens, len(samples))

    # -- helpers -------------------------------------------------------------------------------

    @staticmethod
    def _owner() -> bool:
        """Only TP rank 0 of the last stage of each DP replica owns the loss's numbers."""
        return mpu.is_pipeline_last_stage(ignore_virtual=True) and mpu.get_tensor_model_parallel_rank() == 0

    @staticmethod
    def _device() -> torch.device:
        # the collectives' device: NCCL reduces CUDA tensors, gloo CPU ones
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    def _reduce_stats(self, stats: List[torch.Tensor]) -> torch.Tensor:
        """Sum over micro-batches and DP ranks (max for ratio_max); the same on every rank."""
        device = self._device()
        total = torch.zeros(len(self.stat_fields), dtype=torch.float64, device=device)
        ratio_max = torch.zeros(1, dtype=torch.float64, device=device)
        if self._owner():
            for s in stats:
                s = s.to(device, torch.float64)
                total += s
                ratio_max = torch.maximum(ratio_max, s[RATIO_MAX : RATIO_MAX + 1])
        dist.all_reduce(total)
        dist.all_reduce(ratio_max, op=dist.ReduceOp.MAX)
        total[RATIO_MAX] = ratio_max[0]
        return total.cpu()

    def _hand_back_logprobs(self, samples: Sequence[Sample], plan: PackingPlan) -> None:
        """Each sample's log pi (as the loss saw it) into its trainer_logprobs, on every rank;
        None at a masked token.

        The owner of each micro-batch writes its samples' slots of one flat vector of the
        step's trained tokens; one SUM all-reduce gives every rank all of them."""
        flat = torch.zeros(sum(s.trained_tokens for s in samples), dtype=torch.float32, device=self._device())
        if self._owner():
            trained_logprobs_flat(samples, plan.micro_batches, flat)
        dist.all_reduce(flat)
        for s, values in zip(samples, per_sample_logprobs(samples, flat.tolist())):
            s.trainer_logprobs = values

    def _nonfinite_reason(self, totals: torch.Tensor) -> Optional[str]:
        loss_sum = totals[BASE_FIELDS.index("loss_sum")].item()
        # One NaN or inf anywhere makes the sum non-finite: a single cheap pass
        # (isfinite().all() over the whole buffer costs several passes).
        local_ok = all(
            bool(torch.isfinite(buffer.grad_data.sum()))
            for chunk in self.ddp_chunks
            for buffer in chunk.buffers + chunk.expert_parallel_buffers
        )
        flag = torch.tensor([1.0 if local_ok else 0.0], device=self._device())
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if not math.isfinite(loss_sum):
            return f"non-finite loss ({loss_sum})"
        if flag.item() < 1.0:
            return "non-finite gradient"
        if totals[BASE_FIELDS.index("tokens")].item() == 0:
            return "no trained tokens in the batch"
        return None

    def _metrics(self, totals, grad_norm, reason, plan, elapsed, real_tokens, n_samples) -> dict:
        return {
            **metrics_from_totals(totals, self.loss.lag_bound),
            **self.overlong_info,
            "samples": n_samples,
            "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            # the learning rate this step's update used (the scheduler moves it after the update)
            "lr": self.lr_used,
            "skipped": reason is not None,
            "skip_reason": reason or "",
            "packing_efficiency": plan.efficiency,
            "micro_batches": len(plan.micro_batches),
            "time_train": elapsed,
            "peak_memory_gb": torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else None,
            "tokens_per_s": real_tokens / elapsed,
            **self.moe_metrics,  # aux / z losses of models with experts (trainer/moe_losses.py)
        }
