"""The single controller: the same event loop on every rank (LlamaRL, Algorithm 1).

Each iteration: set the step, let the local executors work, run the channels,
sync the weights, checkpoint. What runs concurrently is decided only by which
ranks the executors own (topology.py) and, in time, by run.mode's schedule
(schedule.py: the loop asks it, never the mode):

    async   iteration i: generators make batch i  ||  trainer trains batch i-1
            rollouts (GATHER) + batch (BROADCAST): batch i -> every trainer rank
            weights: policy version i, shard to shard, swapped in between decode
            steps (sequences in flight continue under it: partial rollouts)
    sync    iteration i: every rank generates its share with policy i, the
            batch is gathered and broadcast, the trainer steps, and each rank
            copies the new policy into its own engine: generation and training
            alternate on the same ranks (the baseline)

Metrics of training step k (metrics.jsonl) are written by the trainer's first rank.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import List, Optional

import torch.distributed as dist

from megarl.channels import Channel
from megarl.config import Config, config_from_dict
from megarl.executors.evaluator import eval_steps
from megarl.loop_state import checkpoint_loop_state, generator_states, resume_point
from megarl.runtime import preemption
from megarl.schedule import make_schedule
from megarl.topology import Topology

CHECKPOINTS = "checkpoints"


def _broadcast_from_rank0(job, value):
    box = [value]
    dist.broadcast_object_list(box, group=job.control, group_src=0)
    return box[0]


def _load_prompts(cfg: Config, tokenizer, vocab_size: int, source: Optional[str] = None) -> list:
    """Tokenized prompts of ``source`` (default data.train)."""
    from megarl.data.datasets import load_records, tokenize_prompts

    source = source or cfg.data.train
    if source.startswith("random:"):  # token ids: no tokenizer involved
        from megarl.data.random_tokens import random_token_prompts

        return random_token_prompts(source, vocab_size, cfg.data.max_prompt_tokens)
    return tokenize_prompts(load_records(source), tokenizer, cfg.data.max_prompt_tokens)


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f}" if seconds >= 600 else f"{seconds / 60:.2f}"


def _collective_timeout_s(cfg: Config) -> float:
    """How long a collective may wait for a peer: the first weight sync waits for SGLang
    servers to start (launched: the checkpoint's conversion and the load included)."""
    g = cfg.generator
    if g.backend == "sglang":
        return max(600.0 + 2 * g.sglang_startup_timeout_s, cfg.run.hang_timeout_s + 120)
    # the hang watchers (runtime/heartbeat.py) speak first, with a better message than a timeout
    return max(600.0, cfg.run.hang_timeout_s + 120)


class Controller:
    def __init__(self, cfg: Config, prepared):
        from megarl.models.spec import LlamaSpec
        from megarl.runtime.job import init_job

        self.cfg = cfg
        self.topo = Topology.from_config(cfg)
        self.job = job = init_job(self.topo, timeout_s=_collective_timeout_s(cfg))
        from megarl.runtime.heartbeat import Heartbeat

        role = "trainer" if job.has("trainer") else "generator"
        if job.has("generator") and not job.has("trainer"):  # a generator rank of its own (async)
            replica, tp_rank = self.topo.replica_of(job.rank)
            role = f"generator replica {replica}, TP rank {tp_rank}"
        self.heartbeat = Heartbeat(job.store, job.rank, job.world_size, role, cfg.run.hang_timeout_s)
        self._set_cpu_threads()
        self.spec = LlamaSpec.from_dict(prepared.spec)
        self.out = Path(cfg.run.output_dir)
        self.trainer = self.generator = self.reward = self.evaluator = None
        self.tp_group = None
        self.last_sync = None  # this rank's SyncStats of the last weight sync
        root = self.out / CHECKPOINTS
        from megarl.checkpointing.resume import resumable_checkpoint_dir

        # the newest checkpoint whose files match its manifest (all ranks share the checksums);
        # each newer, damaged one is named in a warning
        resume = resumable_checkpoint_dir(root, group=job.control)
        if job.has("trainer"):
            from megarl.executors.trainer import TrainerExecutor

            lag_bound = cfg.rollout.max_lag if cfg.run.mode == "async" else 0  # sync trains on lag 0 only
            self.trainer = TrainerExecutor(cfg, job, prepared, resume, lag_bound)
        # where a resumed run continues (runtime state of the checkpoint, loop_state.py)
        self.resume = _broadcast_from_rank0(job, resume_point(self.trainer.loop_state) if job.rank == 0 else None)
        self.start = self.resume.next_iteration
        if job.has("generator"):
            self._init_generator(prepared)
            if self.generator is not None and self.resume.generators:
                replica, _ = self.topo.replica_of(job.rank)
                self.generator.load_state_dict(self.resume.generators[replica])
        self.schedule = make_schedule(cfg.run.mode)  # when to generate, train and sync (schedule.py)
        self.per_replica = cfg.rollout.prompts_per_step // self.topo.generator_replicas  # groups per step
        self.channels = {c.name: Channel(c, job.rank, job.control) for c in self.topo.channels if c.kind != "WEIGHTS"}
        from megarl.weight_sync.factory import make_weight_synchronizer

        # the weights channel: how the policy travels is the synchronizer's business alone
        self.weights = make_weight_synchronizer(cfg, job, self.spec, self.trainer, self.generator)

    def _set_cpu_threads(self) -> None:
        """On CPU, ranks share the cores: an async trainer that is busier than its generator may
        take more threads than an even split (the generator's core is idle while it waits)."""
        if self.job.device != "cpu":
            return
        import torch

        n = self.cfg.trainer.cpu_threads if self.job.has("trainer") else self.cfg.generator.cpu_threads
        if n:
            torch.set_num_threads(n)

    def _init_generator(self, prepared) -> None:
        from megarl.executors.generator import GeneratorExecutor
        from megarl.executors.reward import RewardExecutor
        from megarl.generator.factory import ReplicaPlacement, build_backend
        from megarl.generator.tokenizer import load_tokenizer, stop_ids
        from megarl.runtime.failure import fail_rank

        cfg, job = self.cfg, self.job
        replica, tp_rank = self.topo.replica_of(job.rank)
        engine_tp = self.topo.generator_tp if self.topo.generator_backend == "torch" else 1
        if engine_tp > 1:  # (sync mode's engines are TP1, one per rank: topology.py)
            first = self.topo.executors["generator"][0]
            for ranks in self.topo.generator_tp_groups():  # every generator rank creates every group
                group = dist.new_group([r - first for r in ranks])
                if job.rank in ranks:
                    self.tp_group = group
        if not self.topo.runs_generator(job.rank):
            return  # an SGLang replica's other ranks: its server's workers use their GPUs
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        placement = ReplicaPlacement(
            replica,
            engine_tp,
            tp_rank,
            self.tp_group,
            job.device,
            local_rank=job.local_rank % gpus if gpus else job.local_rank,
        )
        backend = build_backend(
            cfg.generator,
            self.spec,
            placement,
            cfg.rollout.samples_per_prompt,
            run_dir=self.out,
            store=job.store,
            on_failure=fail_rank,
        )
        tokenizer = load_tokenizer(prepared.tokenizer)
        self.generator = GeneratorExecutor(
            cfg.rollout,
            cfg.generator.max_running,
            cfg.run.seed,
            backend,
            _load_prompts(cfg, tokenizer, self.spec.vocab_size),
            stop_ids(tokenizer),
            replica,
            cfg.rollout.prompts_per_step // self.topo.generator_replicas,
            tp_rank,
            self.tp_group,
        )
        self.generator.on_step = lambda waiting=False: self.heartbeat.beat(
            "waiting for the trainer's step" if waiting else "decoding", waiting=waiting
        )
        if job.has("reward"):
            self.reward = RewardExecutor(cfg, tokenizer)
        from megarl.executors.batch_maker import BatchMaker

        self.batch_maker = BatchMaker(
            self.generator, self.reward, cfg.rollout.filter_groups, cfg.rollout.samples_per_prompt, self.tp_group
        )
        if cfg.data.eval:
            from megarl.executors.evaluator import ReplicaEvaluator

            self.evaluator = ReplicaEvaluator(
                cfg.data,
                self.generator,
                self.reward,
                _load_prompts(cfg, tokenizer, self.spec.vocab_size, cfg.data.eval),
                replica,
                self.topo.generator_replicas,
                job.store,
                job.has("reward"),
            )

    # -- the weights channel ------------------------------------------------------------------

    def sync_weights(self) -> float:
        """The policy the trainer holds -> every generator; returns this rank's seconds."""
        start = time.perf_counter()
        version = _broadcast_from_rank0(self.job, self.trainer.version if self.job.rank == 0 else None)
        self.last_sync = self.weights.sync(version)
        return time.perf_counter() - start

    # -- the loop ----------------------------------------------------------------------------------

    def run(self) -> Optional[dict]:
        cfg, job = self.cfg, self.job
        writer = None
        if job.rank == self.topo.executors["trainer"][0]:
            from megarl.metrics import MetricsWriter

            (self.out).mkdir(parents=True, exist_ok=True)
            (self.out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
            writer = MetricsWriter(
                self.out,
                cfg.run.steps,
                self.resume.steps_done,
                progress=cfg.run.progress,
                wandb=cfg.run.wandb,
                run_config=cfg.to_dict(),
                time_budget_s=cfg.run.time_budget_min * 60.0,
                budget_spent_s=self.resume.train_seconds,
            )
        collector = None
        if writer is not None and cfg.data.eval:
            from megarl.executors.evaluator import EvalCollector

            collector = EvalCollector(job.store, self.topo.generator_replicas, cfg.data.eval_samples, self.out)
        self.sync_weights()  # the generators start from the trainer's policy
        if job.rank in (0, job.world_size - 1):  # two watchers: one stuck watcher hides no hang
            self.heartbeat.watch()
        schedule = self.schedule
        iterations = schedule.iterations(self.start, cfg.run.steps)
        # the batch the trainer trains next (async; trainer ranks); has_pending: whether there is
        # one, known on every rank (a resumed run may start with the checkpoint's)
        pending: Optional[dict] = self.trainer.restored_pending() if self.trainer is not None else None
        has_pending = self.resume.has_pending
        wall_start, trained, written = time.perf_counter(), 0, 0
        # run.time_budget_min: the training loop's seconds, from here (start-up and conversion excluded),
        # summed over the run's launches through the checkpoints; rank 0's clock decides (agree_stop)
        budget_s, spent_before = cfg.run.time_budget_min * 60.0, self.resume.train_seconds
        stop, saved = None, None  # why this launch stopped early: "preempted" | "time_budget"
        if budget_s and spent_before >= budget_s and self.resume.steps_done < cfg.run.steps:
            iterations, stop = range(0), "time_budget"  # every rank knows the resume point: no collective
            if job.rank == 0:
                print(
                    f"megarl: time budget of {cfg.run.time_budget_min:g} min already spent by this run "
                    f"({_minutes(spent_before)} min of training up to step {self.resume.steps_done}); its "
                    f"checkpoint of step {self.resume.steps_done} is in {self.out / CHECKPOINTS}; nothing "
                    f"trained. Raise run.time_budget_min to train further, or use another run.output_dir "
                    f"to start over",
                    file=sys.stderr,
                    flush=True,
                )
        checkpoint_s = 0.0  # time spent saving: reported apart from the loop's wall time
        # held-out evaluations (executors/evaluator.py) at the top of the iteration where step k's
        # policy is in the generators; the last step's after the loop
        evals = (
            [
                k
                for k in eval_steps(cfg.data.eval_every, cfg.run.steps)
                if k > self.resume.steps_done or k == 0 == self.resume.steps_done
            ]
            if cfg.data.eval
            else []
        )
        eval_at = {schedule.eval_iteration(k): k for k in evals if k < cfg.run.steps}
        for it in iterations:
            if it in eval_at:
                self._evaluate(eval_at[it], collector)
            t0 = time.perf_counter()
            make_batch = it < cfg.run.steps
            trains_now = schedule.trains(has_pending)
            work = schedule.work(self, it, make_batch, pending)
            train_metrics = work.train_metrics
            sync_s = 0.0
            if schedule.syncs_after(it, cfg.run.steps, trains_now):
                self.heartbeat.beat(f"iteration {it}: weight sync", force=True, waiting=True)
                sync_s = self.sync_weights()
            wall = time.perf_counter() - t0
            step_done = schedule.step_of(it)
            # stop here? a signal on any rank, or rank 0's budget clock; a step must have been trained in
            # this iteration (async iteration 0 only generates), and the last step ends the run anyway
            over_budget = (
                job.rank == 0
                and budget_s > 0
                and trains_now
                and step_done < cfg.run.steps
                and spent_before + time.perf_counter() - wall_start >= budget_s
            )
            stop = preemption.agree_stop(self.job.control, over_budget)
            if writer is not None and train_metrics is not None:
                trained += len(work.trained["samples"])
                record = self._record(step_done, train_metrics, work.trained, work.batch, wall, sync_s)
                if stop is not None or step_done == cfg.run.steps:  # the launch's last step says why
                    record["stop_reason"] = stop or "steps"
                writer.write(record)
                written += 1
                if collector is not None:
                    collector.collect(writer)
                if cfg.run.log_rollouts:
                    self._log_rollouts(record["step"], train_metrics["trained_version"], work.trained["samples"])
            pending, has_pending = schedule.carry(work, make_batch, self.trainer is not None)
            if stop is not None or (trains_now and self._should_save(step_done)):
                self.heartbeat.beat(
                    f"iteration {it}: saving the checkpoint of step {step_done}", force=True, waiting=True
                )
                save_start = time.perf_counter()
                spent = spent_before + save_start - wall_start
                saved = self._save(step_done, it + 1, pending, spent)
                checkpoint_s += time.perf_counter() - save_start
                if stop is not None:
                    if job.rank == 0:
                        self._say_stopped(stop, step_done, saved, spent, spent_before)
                    break
        stopped_early = stop is not None
        if not stopped_early and cfg.run.steps in evals:
            schedule.before_final_eval(self)
            self._evaluate(cfg.run.steps, collector)
        summary = None
        if writer is not None:
            if collector is not None:
                collector.collect(writer, block=True)
            writer.close()
            from megarl.metrics import read_metrics, summarize

            records = [r for r in read_metrics(self.out / "metrics.jsonl") if not r.get("eval")]
            summary = summarize(
                records[len(records) - written :], time.perf_counter() - wall_start - checkpoint_s, trained
            )
            summary["time_checkpoint_s"] = checkpoint_s  # not in wall_s / samples_per_s
            summary["stop_reason"] = stop or "steps"
            if cfg.run.time_budget_min:
                summary.update(
                    time_budget_min=cfg.run.time_budget_min,
                    train_min=(spent_before + time.perf_counter() - wall_start) / 60.0,
                )
            if stop == "preempted":
                summary.update(preempted=True, checkpoint=str(saved))
            elif stop == "time_budget":
                summary.update(checkpoint=str(saved or self.out / CHECKPOINTS))
            (self.out / "summary.json").write_text(json.dumps(summary, indent=1))
        return summary

    def _evaluate(self, step: int, collector) -> None:
        self.heartbeat.beat(f"evaluating step {step}", force=True)
        if self.evaluator is not None and self.topo.runs_generator(self.job.rank):
            self.evaluator.run(step)
        if collector is not None:
            collector.expect(step)

    def _say_stopped(self, stop: str, step: int, saved, spent: float, spent_before: float) -> None:
        if stop == "preempted":
            print(
                f"megarl: preempted ({preemption.requested() or 'signal on another rank'}): "
                f"checkpoint of step {step} saved in {saved}; run the same command again "
                f"to resume",
                file=sys.stderr,
                flush=True,
            )
            return
        launches = f", {_minutes(spent - spent_before)} in this launch" if spent_before else ""
        print(
            f"megarl: time budget of {self.cfg.run.time_budget_min:g} min reached after step {step} "
            f"({_minutes(spent)} min of training{launches}); checkpoint of step {step} saved in {saved}. "
            f"The budget is the run's: the same command again trains nothing more; raise "
            f"run.time_budget_min to continue",
            file=sys.stderr,
            flush=True,
        )

    def _save(
        self, step: int, next_iteration: int, pending: Optional[dict], train_seconds: float = 0.0
    ) -> Optional[Path]:
        """Checkpoint at a step boundary (a collective over every rank): the trainer's state, every
        generator replica's prompt stream and, async, the batch not yet trained."""
        state = (
            self.generator.state_dict()
            if self.generator is not None
            and self.topo.runs_generator(self.job.rank)
            and self.topo.replica_of(self.job.rank)[1] == 0
            else None
        )
        states = [None] * self.job.world_size
        dist.all_gather_object(states, state, group=self.job.control)  # every trainer rank saves the same
        if self.trainer is None:
            return None
        generators = generator_states(states, self.topo)
        loop_state = checkpoint_loop_state(step, next_iteration, generators, pending, train_seconds)
        return self.trainer.save_checkpoint(self.out / CHECKPOINTS, step, loop_state)

    def close(self) -> None:
        self.heartbeat.close()
        """Stop what the generators hold (threads, launched servers)."""
        self.weights.close()
        if self.generator is not None:
            self.generator.close()

    def _log_rollouts(self, step: int, version: int, samples) -> None:
        with open(self.out / "rollouts.jsonl", "a") as f:
            for s in samples:
                f.write(
                    json.dumps(
                        {
                            "step": step,
                            "group": s.group_id,
                            "reward": s.reward,
                            "reward_reason": s.reward_reason,
                            "answer": s.answer,
                            "response": s.response_text,
                            "finish_reason": s.finish_reason,
                            "trained_version": version,
                            "versions": s.policy_versions,
                            "behaviour_logprobs": s.behaviour_logprobs,
                            # the token ids: `megarl train --replay` trains on them again (replay.py)
                            "prompt_tokens": s.prompt_tokens,
                            "response_tokens": s.response_tokens,
                            # log pi of each response token as the trainer's loss saw it: ratios, ESS, replays
                            "trainer_logprobs": s.trainer_logprobs,
                            "loss_mask": s.loss_mask,
                        }
                    )
                    + "\n"
                )

    def _should_save(self, step: int) -> bool:
        every = self.cfg.run.save_every
        return step == self.cfg.run.steps or (every > 0 and step % every == 0)

    def transfer_batch(self, it: int, gen_out: Optional[dict]) -> Optional[dict]:
        """The replicas' rollouts (GATHER) -> one batch on every trainer rank (BROADCAST)."""
        self.heartbeat.beat(f"iteration {it}: gathering and broadcasting batch {it}", force=True, waiting=True)
        gathered = self.channels["rollouts"].transfer(gen_out if self.reward is not None else None)
        return self.channels["batch"].transfer(self._merge(gathered) if gathered is not None else None)

    @staticmethod
    def _merge(parts: List[dict]) -> dict:
        """The replicas' outputs -> one batch (samples in replica order) and their timings."""
        samples = [s for p in parts for s in p["samples"]]
        return {
            "samples": samples,
            "time_generate": max(p["time_generate"] for p in parts),
            "time_reward": max(p["time_reward"] for p in parts),
            "stale_dropped": sum(p["stale_dropped"] for p in parts),
            "stale_aborted": sum(p["stale_aborted"] for p in parts),
            "reward_timeouts": sum(p["reward_timeouts"] for p in parts),
            "filtered_groups": sum(p["filtered_groups"] for p in parts),
            "filter_extra_samples": sum(p["filter_extra_samples"] for p in parts),
            "generated_tokens": sum(len(s.response_tokens) for s in samples),
            "in_flight": sum(p["in_flight"] for p in parts),
        }

    def _record(self, step: int, m: dict, trained: dict, current: Optional[dict], wall: float, sync_s: float) -> dict:
        """Training step ``step`` (its batch: ``trained``) and what the generators did meanwhile (``current``)."""
        samples = trained["samples"]
        gen_s = current["time_generate"] if current else 0.0
        reward_s = current["time_reward"] if current else 0.0
        rewards = [s.reward for s in samples]
        time_train = m.get("time_train", 0.0)
        record = {
            "step": step,
            "mode": self.cfg.run.mode,
            "policy_version": self.trainer.version,
            "reward_mean": sum(rewards) / len(rewards),
            "accuracy": sum(r >= 1.0 for r in rewards) / len(rewards),
            "samples": len(samples),
            "samples_per_s": len(samples) / wall,
            "tokens_per_s": (current["generated_tokens"] if current else 0) / wall,
            "response_len_mean": trained["generated_tokens"] / len(samples),
            "time_step": wall,
            "time_generate": gen_s,
            "time_reward": reward_s,
            "time_train": time_train,
            "time_weight_sync": sync_s,
            "idle_trainer": max(0.0, wall - time_train - sync_s),
            "idle_generator": max(0.0, wall - gen_s - reward_s - sync_s),
            "stale_dropped": trained["stale_dropped"],
            "stale_aborted": trained["stale_aborted"],
            "reward_timeouts": trained["reward_timeouts"],
            # rollout.filter_groups: groups of one reward not trained, and the samples refilling cost
            "filtered_groups": trained.get("filtered_groups", 0),
            "filter_extra_samples": trained.get("filter_extra_samples", 0),
            "in_flight": current["in_flight"] if current else 0,
            "weight_sync_verified": self.cfg.generator.verify_sync and self.schedule.verifies_sync,
            # the trainer's own rate (its step's tokens / its step's time), the generators' while generating
            "train_tokens_per_s": m.get("tokens_per_s", 0.0),
            "generator_tokens_per_s": (current["generated_tokens"] / gen_s) if current and gen_s else 0.0,
            # bytes this (first trainer) rank sent in the sync, and the sync's rate
            "weight_sync_bytes": self.last_sync.bytes_sent if sync_s and self.last_sync else 0,
            "weight_sync_transfer_s": self.last_sync.seconds if sync_s and self.last_sync else 0.0,
        }
        record.update({k: v for k, v in m.items() if k not in record and not isinstance(v, (list, dict))})
        return record


def concrete_config(cfg_dict: dict) -> Config:
    """The rank's config with no ``auto`` dtype left: `megarl train` resolves it before the launch
    (and says so); a caller that starts ranks itself gets the same resolution here."""
    from megarl.runtime.cpu_dtype import resolve_auto_dtypes

    cfg = config_from_dict(cfg_dict)
    resolve_auto_dtypes(cfg)
    return cfg


def run_rank(cfg_dict: dict, prepared) -> None:
    # SIGUSR1 (and SIGTERM when this process is its own launcher): checkpoint at the next step
    # boundary and exit 0
    import os
    import signal

    from megarl.runtime.distributed import shutdown

    preemption.install(signals=(signal.SIGUSR1,) if "RANK" in os.environ else preemption.SIGNALS)
    controller = Controller(concrete_config(cfg_dict), prepared)
    try:
        controller.run()
    finally:
        controller.close()
    shutdown()
