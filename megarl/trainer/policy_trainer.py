"""One RL optimizer step on Megatron-Core: rollouts in, updated policy and metrics out.

    advantages (group baseline / RLOO)  ->  pack into micro-batches per DP rank
    -> [reference model log-probs, if a KL penalty is configured]
    -> Megatron's forward_backward_func with the loss hook
    -> non-finite guard  ->  optimizer step (gradient clipping inside)

Every rank of the trainer calls ``step`` with the same list of samples; each
rank picks its own DP shard. The returned metrics are identical on every rank.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from megarl.rollout import Sample, validate_samples
from megarl.trainer.advantages import compute_advantages
from megarl.trainer.hooks import STAT_FIELDS, LossConfig, make_forward_step, make_logprob_collector
from megarl.trainer.losses import bind_loss_params, resolve_loss
from megarl.trainer.packing import PackingPlan, plan_micro_batches
from megarl.trainer.setup import run_schedule, zero_grads

logger = logging.getLogger(__name__)
RATIO_MAX = STAT_FIELDS.index("ratio_max")


class PolicyTrainer:
    def __init__(
        self,
        ddp_chunks: list,
        optimizer,
        vocab_size: int,
        loss: LossConfig,
        max_tokens_per_microbatch: int,
        ref_chunks: Optional[list] = None,
        thd: Optional[bool] = None,
        lr_scheduler=None,
    ):
        from megarl.models.megatron_llama import transformer_engine_usable

        # defaults filled in, every value checked against the loss's declared parameters
        loss = dataclasses.replace(loss, params=bind_loss_params(loss.name, loss.params))
        if loss.kl_coef and ref_chunks is None:
            raise ValueError("loss.kl_coef > 0 needs a reference model (ref_chunks)")
        self.ddp_chunks = ddp_chunks
        self.optimizer = optimizer
        self.vocab_size = vocab_size
        self.loss = loss
        self.loss_fn = resolve_loss(loss.name)
        self.max_tokens = max_tokens_per_microbatch
        self.ref_chunks = ref_chunks
        self.lr_scheduler = lr_scheduler  # Megatron's OptimizerParamScheduler, stepped after each update
        self.thd = transformer_engine_usable() if thd is None else thd

    # -- data ------------------------------------------------------------------------------

    def plan(self, samples: Sequence[Sample]) -> PackingPlan:
        from megatron.core import parallel_state as mpu

        validate_samples(samples)
        advantages = compute_advantages(samples, self.loss.advantage_estimator, self.loss.normalize_advantage_std)
        pp = mpu.get_pipeline_model_parallel_world_size()
        config = self.ddp_chunks[0].config
        vp = config.virtual_pipeline_model_parallel_size
        return plan_micro_batches(
            samples, advantages, mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size(),
            self.max_tokens, fixed_row_length=pp > 1, thd=self.thd, count_multiple=pp if vp else 1,
            row_multiple=mpu.get_tensor_model_parallel_world_size() if config.sequence_parallel else 1,
        )

    # -- the step ----------------------------------------------------------------------------

    def forward_backward(self, samples: Sequence[Sample]):
        """Gradients of the loss over ``samples`` in the DDP buffers; returns (plan, per-micro-batch stats)."""
        plan = self.plan(samples)
        if self.ref_chunks is not None:
            collector = make_logprob_collector(self.vocab_size, self.loss.temperature)
            with torch.no_grad():
                run_schedule(self.ref_chunks, collector, plan.micro_batches, plan.seq_length, 1,
                             forward_only=True, collect_non_loss_data=True)
        zero_grads(self.ddp_chunks, self.optimizer)
        outputs = run_schedule(self.ddp_chunks, make_forward_step(self.loss_fn, self.loss, self.vocab_size),
                               plan.micro_batches, plan.seq_length, 1, forward_only=False)
        return plan, [o["stats"] for o in outputs]

    def step(self, samples: Sequence[Sample]) -> dict:
        start = time.perf_counter()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        self.lr_used = self.optimizer.param_groups[0]["lr"]
        plan, stats = self.forward_backward(samples)
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
        real_tokens = sum(len(s) for s in samples)
        return self._metrics(totals, grad_norm, reason, plan, elapsed, real_tokens, len(samples))

    # -- helpers -------------------------------------------------------------------------------

    def _reduce_stats(self, stats: List[torch.Tensor]) -> torch.Tensor:
        """Sum over micro-batches and DP ranks (max for ratio_max); the same on every rank."""
        from megatron.core import parallel_state as mpu

        total = torch.zeros(len(STAT_FIELDS), dtype=torch.float64)
        ratio_max = torch.zeros(1, dtype=torch.float64)
        for s in stats:
            total += s.double()
            ratio_max = torch.maximum(ratio_max, s[RATIO_MAX : RATIO_MAX + 1].double())
        # Only TP rank 0 of the last stage of each DP replica owns the numbers.
        owner = mpu.is_pipeline_last_stage(ignore_virtual=True) and mpu.get_tensor_model_parallel_rank() == 0
        if not owner:
            total.zero_()
            ratio_max.zero_()
        dist.all_reduce(total)
        dist.all_reduce(ratio_max, op=dist.ReduceOp.MAX)
        total[RATIO_MAX] = ratio_max[0]
        return total

    def _nonfinite_reason(self, totals: torch.Tensor) -> Optional[str]:
        loss_sum = totals[STAT_FIELDS.index("loss_sum")].item()
        # One NaN or inf anywhere makes the sum non-finite: a single cheap pass
        # (isfinite().all() over the whole buffer costs several passes).
        local_ok = all(
            bool(torch.isfinite(buffer.grad_data.sum()))
            for chunk in self.ddp_chunks
            for buffer in chunk.buffers + chunk.expert_parallel_buffers
        )
        flag = torch.tensor([1.0 if local_ok else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if not math.isfinite(loss_sum):
            return f"non-finite loss ({loss_sum})"
        if flag.item() < 1.0:
            return "non-finite gradient"
        if totals[STAT_FIELDS.index("tokens")].item() == 0:
            return "no response tokens in the batch"
        return None

    def _metrics(self, totals, grad_norm, reason, plan, elapsed, real_tokens, n_samples) -> dict:
        t = dict(zip(STAT_FIELDS, totals.tolist()))
        n = max(t["tokens"], 1.0)
        return {
            "loss": t["loss_sum"] / n,
            "response_tokens": int(t["tokens"]),
            "samples": n_samples,
            "clip_frac": t["clipped"] / n,
            "ratio_mean": t["ratio_sum"] / n,
            "ratio_max": t["ratio_max"],
            # ESS = (sum w)^2 / (N sum w^2) over response tokens, w = pi / mu
            "ess": (t["ratio_sum"] ** 2) / (n * t["ratio_sq_sum"]) if t["ratio_sq_sum"] > 0 else float("nan"),
            "kl_mu_pi": t["kl_mu_pi_sum"] / n,
            "kl_ref": t["kl_ref_sum"] / n,
            "entropy": t["entropy_sum"] / n,
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
        }
