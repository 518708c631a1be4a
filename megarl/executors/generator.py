"""The generator executor: one replica of megarl's torch engine (TP over its own group).

``generate(train_version, n_groups)`` keeps the engine's slots full and
returns the first ``n_groups`` prompt groups whose samples have all
finished. In async mode sequences still in flight stay in the engine across
steps (partial rollouts) and continue under each new policy version; the
weights are replaced between decode steps (``receive_weights``), never by
draining the batch.

Admission control for ``rollout.max_lag``: a group is handed to the trainer
only if every token of it will be at most ``max_lag`` versions behind the
policy that trains on it (``train_version``); an older group is dropped and
a fresh prompt takes its place (counted in ``stale_dropped``).
"""

from __future__ import annotations

import time
from typing import Dict, List

import torch

from megarl.generator.interface import Completion, GenerationRequest, SamplingParams


class GeneratorExecutor:
    def __init__(self, cfg, spec, prompts, stop_ids, replica: int, tp_rank: int, tp_group, device: str = "cpu"):
        from megarl.data.datasets import PromptStream
        from megarl.generator.torch_engine.engine import TorchEngine
        from megarl.weight_sync.endpoints import allocate_generator_params

        g = cfg.generator
        self.cfg, self.replica, self.tp_rank = cfg, replica, tp_rank
        tp = g.tp if cfg.run.mode == "async" else 1
        dtype = torch.bfloat16 if g.dtype == "bf16" else torch.float32
        self.params = allocate_generator_params(spec, tp, tp_rank, dtype, g.fp8, device=device)
        self.engine = TorchEngine(spec, self.params, max_running=g.max_running, max_seq_len=g.max_seq_len, tp=tp,
                                  tp_rank=tp_rank, group=tp_group, recompute_kv_on_update=g.recompute_kv_on_update)
        # every TP rank of a replica draws the same prompts in the same order
        self.stream = PromptStream(prompts, seed=cfg.run.seed * 1000 + replica)
        self.stop_ids = tuple(stop_ids)
        self.groups: Dict[int, List[Completion]] = {}
        self.next_group = 0
        self.ready: List[List[Completion]] = []  # finished groups not yet handed over
        self.stale_dropped = 0

    def _request(self) -> GenerationRequest:
        r = self.cfg.rollout
        prompt = next(self.stream)
        gid = self.next_group * 1_000 + self.replica  # unique over replicas
        self.next_group += 1
        params = SamplingParams(temperature=r.temperature, top_p=r.top_p, max_new_tokens=r.max_new_tokens,
                                stop_token_ids=self.stop_ids, seed=(self.cfg.run.seed * 7919 + gid) % (2 ** 31))
        return GenerationRequest(f"g{gid}", list(prompt.ids), params, n=r.samples_per_prompt, group_id=gid,
                                 meta={"answer": prompt.record.answer, **prompt.record.meta})

    def _keep_full(self) -> None:
        """Every slot busy, and a queue so that freed slots refill at once."""
        n = self.cfg.rollout.samples_per_prompt
        while self._in_engine() + n <= self.cfg.generator.max_running + n:
            self.engine.submit([self._request()])

    def _step_engine(self) -> None:
        """One engine step; finished samples join their group, complete groups wait in ``ready``."""
        n = self.cfg.rollout.samples_per_prompt
        for c in self.engine.step():
            group = self.groups.setdefault(c.group_id, [])
            group.append(c)
            if len(group) == n:
                del self.groups[c.group_id]
                self.ready.append(sorted(group, key=lambda x: x.sample_index))

    def _in_engine(self) -> int:
        s = self.engine.stats()
        return int(s["queue_depth"] + s["running"])

    def generate(self, train_version: int, n_groups: int, drain: bool) -> dict:
        """Groups for the trainer, and this replica's timing.

        ``drain`` (sync mode): submit exactly n_groups prompts and run them to the end.
        """
        start = time.perf_counter()
        if drain:
            self.engine.submit([self._request() for _ in range(n_groups)])
        while True:
            self.ready = [g for g in self.ready if self._fresh(g, train_version, drain)]
            if len(self.ready) >= n_groups:
                break
            if not drain:
                self._keep_full()
            self._step_engine()
        return self._hand_over(n_groups, start)

    def _hand_over(self, n_groups: int, start: float) -> dict:
        ready, self.ready = self.ready[:n_groups], self.ready[n_groups:]
        return {"groups": ready, "time_generate": time.perf_counter() - start,
                "engine_version": self.engine.version, "stale_dropped": self.stale_dropped,
                "in_flight": self._in_engine()}

    def generate_until(self, stop, tp_group=None) -> int:
        """Keep decoding (groups that finish wait for the next batch) until ``stop()`` says the
        trainer is done: PipelineRL's generator never idles while the trainer works. The
        replica's first rank decides; its TP peers follow, so all run the same steps."""
        import torch.distributed as dist

        steps = 0
        while True:
            flag = torch.tensor([1 if (self.tp_rank == 0 and stop()) else 0])
            if tp_group is not None:
                dist.broadcast(flag, group=tp_group, group_src=0)
            if flag.item():
                return steps
            self._keep_full()
            self._step_engine()
            steps += 1

    def _fresh(self, group: List[Completion], train_version: int, drain: bool) -> bool:
        oldest = min(min(c.versions) for c in group)
        if drain or train_version - oldest <= self.cfg.rollout.max_lag:
            return True
        self.stale_dropped += 1  # too old to train on: dropped, a fresh prompt takes its slot
        return False

    def receive_weights(self, apply, version: int) -> None:
        """Between decode steps: in-flight sequences keep their KV cache (or recompute it)."""
        self.engine.update_weights(apply, version)
