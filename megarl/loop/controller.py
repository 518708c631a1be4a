"""The single controller: the same event loop on every rank (LlamaRL, Algorithm 1).

Each iteration: let the local executors work, run the channels, sync the weights,
checkpoint. What runs concurrently is decided only by which ranks the executors own
(megarl/layout.py) and, in time, by run.mode's schedule (schedule.py: the loop asks it,
never the mode); everything a rank runs is wired by wiring.py:

    async   iteration i: generators make batch i  ||  trainer trains batch i-1
            rollouts (GATHER) + batch (BROADCAST): batch i -> every trainer rank
            weights: policy version i, shard to shard, swapped in between decode
            steps (sequences in flight continue under it: partial rollouts)
    sync    iteration i: every rank generates its share with policy i, the
            batch is gathered and broadcast, the trainer steps, and each rank
            copies the new policy into its own engine: generation and training
            alternate on the same ranks (the baseline)

Metrics of training step k (metrics.jsonl) are written by the trainer's first rank, which also
judges each step's health against the run's first steps (megarl/health.py: health.action warn
says so, stop ends the run at that step boundary with its checkpoint saved).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Optional

import torch.distributed as dist

from megarl.checkpointing.resume import list_iterations
from megarl.executors.evaluator import EvalCollector
from megarl.health import HealthWatch
from megarl.loop import records
from megarl.loop.batch import Batch
from megarl.loop.loop_state import checkpoint_loop_state, generator_states, pending_from_state
from megarl.loop.run_clock import EvalPlan, RunClock
from megarl.loop.schedule import StepParts, TrainerDone
from megarl.loop.wiring import CHECKPOINTS, Rank, concrete_config, wire_rank
from megarl.metrics import MetricsWriter, read_metrics, summarize
from megarl.runtime import preemption
from megarl.runtime.distributed import shutdown


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f}" if seconds >= 600 else f"{seconds / 60:.2f}"


class Controller:
    def __init__(self, rank: Rank):
        self.rank = rank
        self.cfg, self.job, self.topo = rank.cfg, rank.job, rank.topo
        self.trainer, self.generator, self.evaluator = rank.trainer, rank.generator, rank.evaluator
        self.schedule, self.heartbeat, self.resume = rank.schedule, rank.heartbeat, rank.resume
        self.out = rank.out
        self.start = self.resume.next_iteration
        self.last_sync = None  # this rank's SyncStats of the last weight sync
        self.parts = StepParts(
            trainer=rank.trainer,
            batch_maker=rank.batch_maker,
            generator=rank.generator,
            groups_per_replica=rank.groups_per_replica,
            transfer=self.transfer_batch,
            trainer_done=TrainerDone(self.job.store, setter=self.job.rank == self.topo.first_trainer_rank),
            beat=lambda what: self.heartbeat.beat(what, force=True),
            sync_weights=self.sync_weights,
        )

    # -- the weights channel ------------------------------------------------------------------

    def sync_weights(self) -> float:
        """The policy the trainer holds -> every generator; returns this rank's seconds."""
        start = time.perf_counter()
        box = [self.trainer.version if self.job.rank == 0 else None]
        dist.broadcast_object_list(box, group=self.job.control, group_src=0)
        self.last_sync = self.rank.weights.sync(box[0])
        return time.perf_counter() - start

    # -- the loop ----------------------------------------------------------------------------------

    def run(self) -> Optional[dict]:
        cfg, job, schedule = self.cfg, self.job, self.schedule
        writer = self._metrics_writer()
        health = self._health_watch() if writer is not None else None
        collector = None
        if writer is not None and cfg.data.eval:
            collector = EvalCollector(job.store, self.topo.generator.replicas, cfg.data.eval_samples, self.out)
        self.sync_weights()  # the generators start from the trainer's policy
        if job.rank in (0, job.world_size - 1):  # two watchers: one stuck watcher hides no hang
            self.heartbeat.watch()
        iterations = schedule.iterations(self.start, cfg.run.steps)
        # the batch the trainer trains next (async; trainer ranks); has_pending: whether there is
        # one, known on every rank (a resumed run may start with the checkpoint's)
        pending: Optional[Batch] = (
            pending_from_state(self.trainer.loop_state.get("pending")) if self.trainer is not None else None
        )
        has_pending = self.resume.has_pending
        clock, trained, written = RunClock(cfg, self.resume, job), 0, 0
        stop, saved = None, None  # why this launch stopped early: "preempted" | "time_budget" | "health"
        if clock.already_spent(self.resume.steps_done):
            iterations, stop = range(0), "time_budget"  # every rank knows the resume point: no collective
            self._say_budget_spent(clock)
        evals = EvalPlan(cfg, schedule, self.resume.steps_done)
        for it in iterations:
            if it in evals.at:
                self._evaluate(evals.at[it], collector)
            t0 = time.perf_counter()
            make_batch, trains_now = it < cfg.run.steps, schedule.trains(has_pending)
            work = schedule.work(self.parts, it, make_batch, pending)  # generate and train
            sync_s = self._sync_after(it, trains_now)
            wall, step_done = time.perf_counter() - t0, schedule.step_of(it)
            over_budget = clock.over_budget(trains_now, step_done)
            record = self._record(work, step_done, wall, sync_s, health, writer)
            trained += len(work.trained.samples) if record is not None else 0
            # as the budget: the last step ends the run anyway (the summary says it degraded)
            stop = clock.agree_stop(
                over_budget, record is not None and step_done < cfg.run.steps and health.should_stop
            )
            if record is not None:
                self._write(record, stop, work, writer, collector)
                written += 1
            pending, has_pending = schedule.carry(work, make_batch, self.trainer is not None)
            if stop is not None or (trains_now and self._should_save(step_done)):
                saved, spent = self._save_step(it, step_done, pending, clock)
                if stop is not None:
                    self._say_why_stopped(stop, step_done, saved, spent, clock, writer, health)
                    break
        if stop is None and evals.after_loop:
            schedule.before_final_eval(self.parts)
            self._evaluate(cfg.run.steps, collector)
        if writer is None:
            return None
        return self._finish(writer, collector, health, clock, stop, saved, written, trained)

    # -- what the loop's body asks ------------------------------------------------------------------

    def _metrics_writer(self) -> Optional[MetricsWriter]:
        """The trainer's first rank writes the run's config and its records; None elsewhere."""
        cfg = self.cfg
        if self.job.rank != self.topo.first_trainer_rank:
            return None
        (self.out).mkdir(parents=True, exist_ok=True)
        (self.out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
        return MetricsWriter(
            self.out,
            cfg.run.steps,
            self.resume.steps_done,
            progress=cfg.run.progress,
            wandb=cfg.run.wandb,
            run_config=cfg.to_dict(),
            time_budget_s=cfg.run.time_budget_min * 60.0,
            budget_spent_s=self.resume.train_seconds,
        )

    def _sync_after(self, it: int, trains_now: bool) -> float:
        """The weight sync after iteration ``it``, where the schedule has one; its seconds."""
        if not self.schedule.syncs_after(it, self.cfg.run.steps, trains_now):
            return 0.0
        self.schedule.before_sync(self.parts)
        self.heartbeat.beat(f"iteration {it}: weight sync", force=True, waiting=True)
        return self.sync_weights()

    def _record(self, work, step: int, wall: float, sync_s: float, health, writer) -> Optional[dict]:
        """The step's metrics record, judged by the health watch: on the writing rank, where a step trained."""
        if writer is None or work.train_metrics is None:
            return None
        record = records.step_record(
            step,
            self.rank.run_mode,
            self.trainer.version,
            work.train_metrics,
            work.trained,
            work.batch,
            wall,
            sync_s,
            self.last_sync,
            self.rank.verifies_sync,
        )
        verdict = health.observe(record)
        record.update(verdict.fields())
        if verdict.degraded:
            writer.say(
                f"megarl: health: step {verdict.step} degraded: {record['health_reasons']} "
                f"(health.action={self.cfg.health.action})"
            )
        return record

    def _write(self, record: dict, stop: Optional[str], work, writer: MetricsWriter, collector) -> None:
        if stop is not None or record["step"] == self.cfg.run.steps:  # the launch's last step says why
            record["stop_reason"] = stop or "steps"
        writer.write(record)
        if collector is not None:
            collector.collect(writer)
        if self.cfg.run.log_rollouts:
            records.log_rollouts(
                self.out / "rollouts.jsonl", record["step"], work.train_metrics["trained_version"], work.trained.samples
            )

    def _save_step(self, it: int, step: int, pending: Optional[Batch], clock: RunClock) -> tuple:
        """(the checkpoint saved, the run's training seconds when it started)."""
        self.heartbeat.beat(f"iteration {it}: saving the checkpoint of step {step}", force=True, waiting=True)
        save_start = time.perf_counter()
        spent = clock.spent(save_start)
        saved = self._save(step, it + 1, pending, spent)
        clock.checkpoint_s += time.perf_counter() - save_start
        return saved, spent

    def _say_why_stopped(self, stop: str, step: int, saved, spent: float, clock: RunClock, writer, health) -> None:
        if stop == "health" and writer is not None:  # the rank that judged says why
            self._say_unhealthy(writer, health, step, saved)
        elif stop != "health" and self.job.rank == 0:
            self._say_stopped(stop, step, saved, spent, clock.spent_before)

    def _say_budget_spent(self, clock: RunClock) -> None:
        if self.job.rank != 0:
            return
        steps_done = self.resume.steps_done
        print(
            f"megarl: time budget of {clock.budget_min:g} min already spent by this run "
            f"({_minutes(clock.spent_before)} min of training up to step {steps_done}); its "
            f"checkpoint of step {steps_done} is in {self.out / CHECKPOINTS}; nothing "
            f"trained. Raise run.time_budget_min to train further, or use another run.output_dir "
            f"to start over",
            file=sys.stderr,
            flush=True,
        )

    def _finish(self, writer, collector, health, clock: RunClock, stop, saved, written: int, trained: int) -> dict:
        """The writing rank: the evaluations still out, then summary.json (this launch's records)."""
        if collector is not None:
            collector.collect(writer, block=True)
        writer.close()
        written_records = [r for r in read_metrics(self.out / "metrics.jsonl") if not r.get("eval")]
        summary = summarize(written_records[len(written_records) - written :], clock.loop_seconds(), trained)
        summary["time_checkpoint_s"] = clock.checkpoint_s  # not in wall_s / samples_per_s
        summary["stop_reason"] = stop or "steps"
        if clock.budget_min:
            summary.update(time_budget_min=clock.budget_min, train_min=clock.spent() / 60.0)
        if stop == "preempted":
            summary.update(preempted=True, checkpoint=str(saved))
        elif stop == "time_budget":
            summary.update(checkpoint=str(saved or self.out / CHECKPOINTS))
        elif stop == "health":
            summary.update(checkpoint=str(saved))
        summary["health"] = health.summary()
        if summary["health"]["status"] == "degraded" and stop != "health":
            h = summary["health"]
            print(
                f"megarl: health: this run degraded: {h['steps_degraded']} of its {h['steps_judged']} steps "
                f"flagged, first at step {h['first_degraded_step']} ({', '.join(h['flagged'])}); "
                f"health_flags and health_reasons in {self.out / 'metrics.jsonl'}",
                file=sys.stderr,
                flush=True,
            )
        (self.out / "summary.json").write_text(json.dumps(summary, indent=1))
        return summary

    def _health_watch(self) -> HealthWatch:
        """The health watch, with the run's history when it resumes (its metrics.jsonl up to the checkpoint)."""
        health = HealthWatch(self.cfg.health)
        path = self.out / "metrics.jsonl"
        if self.resume.steps_done and path.exists():
            health.restore(read_metrics(path), self.resume.steps_done)
        return health

    def _say_unhealthy(self, writer: MetricsWriter, health: HealthWatch, step: int, saved) -> None:
        first = health.streak[0].step
        good = [(k, p) for k, p in list_iterations(self.out / CHECKPOINTS) if k < first]
        before = (
            f"the last checkpoint saved before it: {good[-1][1]} (step {good[-1][0]})"
            if good
            else "no checkpoint was saved before it (run.save_every)"
        )
        writer.say(
            f"megarl: health: stopped after step {step}: degraded {len(health.streak)} steps in a row from step "
            f"{first} ({', '.join(health.streak_checks())}; health.action=stop, health.patience="
            f"{self.cfg.health.patience}); checkpoint of step {step} saved in {saved}; {before}. A relaunch "
            f"resumes from the newest checkpoint and stops again at the next degraded step: change the recipe, "
            f"or set health.action=warn to train on (docs/long-runs.md#health)"
        )

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

    def _save(self, step: int, next_iteration: int, pending: Optional[Batch], train_seconds: float = 0.0):
        """Checkpoint at a step boundary (a collective over every rank): the trainer's state, every
        generator replica's prompt stream and, async, the batch not yet trained. ``train_seconds``:
        rank 0's clock is the run's (every rank's clock differs a little, and Megatron checks that
        the state each trainer rank saves in common is the same on all of them)."""
        state = (
            self.generator.state_dict()
            if self.generator is not None
            and self.topo.runs_generator(self.job.rank)
            and self.topo.replica_of(self.job.rank)[1] == 0
            else None
        )
        gathered = [None] * self.job.world_size
        dist.all_gather_object(gathered, (state, train_seconds), group=self.job.control)
        if self.trainer is None:
            return None
        generators = generator_states([g[0] for g in gathered], self.topo)
        loop_state = checkpoint_loop_state(step, next_iteration, generators, pending, gathered[0][1])
        return self.trainer.save_checkpoint(self.out / CHECKPOINTS, step, loop_state)

    def close(self) -> None:
        self.rank.close()

    def _should_save(self, step: int) -> bool:
        every = self.cfg.run.save_every
        if every > 0 and step % every == 0:
            return True
        return step == self.cfg.run.steps and self.cfg.run.save_final

    def transfer_batch(self, it: int, share: Optional[Batch]) -> Optional[Batch]:
        """The replicas' rollouts (GATHER) -> one batch on every trainer rank (BROADCAST)."""
        self.heartbeat.beat(f"iteration {it}: gathering and broadcasting batch {it}", force=True, waiting=True)
        channels = self.rank.channels
        gathered = channels["rollouts"].transfer(share if self.rank.reward is not None else None)
        return channels["batch"].transfer(Batch.merge(gathered) if gathered is not None else None)


def run_rank(cfg_dict: dict, prepared) -> None:
    # SIGUSR1 and Ctrl-C's SIGINT (and SIGTERM when this process is its own launcher): checkpoint at the
    # next step boundary and exit 0
    preemption.install(signals=preemption.RANK_SIGNALS if "RANK" in os.environ else preemption.SIGNALS)
    controller = Controller(wire_rank(concrete_config(cfg_dict), prepared))
    try:
        controller.run()
    finally:
        controller.close()
    shutdown()
