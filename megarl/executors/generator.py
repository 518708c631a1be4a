"""The generator executor: one generator replica's prompts, groups and admission control.

It talks only to a ``GeneratorBackend`` (generator/interface.py; built by
generator/factory.py from ``generator.backend``): megarl's torch engine in
this process (every TP rank of the replica runs this executor on the same
requests) or an SGLang server over HTTP (the replica's first rank runs it).
Everything here works the same for both:

``generate(train_version, n_groups)`` keeps the backend full -- up to
``generator.max_running`` samples in flight plus one group queued, so a freed
slot refills at once -- and returns ``n_groups`` prompt groups whose samples
have all finished (which ones: the hand-over, below). In async mode sequences still in flight stay in
the backend across steps (partial rollouts) and continue under each new
policy version; weights are replaced between decode steps by the weight
synchronizer (weight_sync/factory.py), never by draining the batch.

The lag bound (``rollout.max_lag``): every token records the policy version that sampled it;
a sample's lag is the training policy's version minus that of its oldest trained token. A group
submitted with the backend at version v holds no token older than v (its samples start at once,
or wait for a slot and start under the same or a newer policy), so the batches T .. v + max_lag
can train it within the bound (T: the batch being made); v + max_lag is its deadline.

- Admission: a group starts only while the groups ready or in flight fit into the batches that
  could still train a group started now -- the batch being made its missing groups, each later
  one ``groups_per_step`` -- so that, taken in the order they started, every group would be
  trained within the bound. A generator faster than the trainer stops there instead of making
  groups it could not hand over in time; one slower than the trainer never reaches the cap.
  (``lag_admission_waits``: backend steps run with a slot that the cap kept empty.)
- Nothing in flight is aborted, and nothing is judged by the version it was submitted under:
  a group finishes under the weight updates that land meanwhile (in-flight updates), and its
  staleness is that of its oldest trained token.
- Hand-over: a batch takes the finished groups oldest first (by their oldest trained token,
  then in the order they finished), so that a group that took long is not passed over by
  younger short ones. A group can still go past its deadline where it takes longer to generate
  than the trainer takes to consume the batches before it; ``rollout.max_lag_policy`` says what
  then happens:

      wait  a batch waits for an older group still in flight where taking younger finished
            ones instead would leave some later batches more groups due than they can hold
            (``lag_handover_waits``: backend steps waited): the bound holds and no group is
            excluded; the trainer may wait for a long group, as a sync run does
      keep  batches never wait; the trainer trains a group past its deadline whole, its old
            tokens under the importance correction (executors/trainer.py)
      mask  batches never wait; the trainer leaves the tokens beyond the bound out of the loss
      drop  batches never wait; a finished group past its deadline is dropped (``stale_dropped``,
            ``lag_dropped_*`` by length) and a fresh prompt takes its place. The groups that go
            past are the long ones, so this policy trains on a batch biased toward short answers:
            it is kept to measure against.

While the trainer steps (``generate_until``) the same admission cap holds for the batch after
the one handed over.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from megarl.data.datasets import PromptStream
from megarl.errors import MegarlError
from megarl.executors.evaluation import sampling_seed
from megarl.generator.interface import ABORTED, Completion, GenerationRequest, GeneratorBackend, SamplingParams
from megarl.rollout import LENGTH_BUCKETS, length_bucket

# what the lag bound cost while one batch was made (per replica, summed over replicas; the module doc)
LAG_COUNT_KEYS = (
    "lag_admission_waits",
    "lag_handover_waits",
    "lag_dropped_groups",
    *(f"lag_dropped_samples_{b}" for b in LENGTH_BUCKETS),
)


def empty_lag_counts() -> Dict[str, int]:
    return dict.fromkeys(LAG_COUNT_KEYS, 0)


@dataclass
class GeneratedGroups:
    """What one ``generate`` call hands over: finished groups and the replica's counters."""

    groups: List[List[Completion]]
    time_generate: float  # seconds of this call
    engine_version: int  # the backend's policy version at hand-over
    stale_dropped: int  # running total of the replica (rollout.max_lag_policy=drop)
    in_flight: int  # samples still in the backend
    # since the replica's previous hand-over (LAG_COUNT_KEYS)
    lag_counts: Dict[str, int] = field(default_factory=empty_lag_counts)


@dataclass
class _InFlight:
    request_id: str
    submitted_version: int  # no token of the group is older (the module doc)
    returned: int = 0  # samples back from the backend


def _oldest(group: List[Completion]) -> Optional[int]:
    """The version of the group's oldest trained token (None: it trains no token)."""
    return min((v for c in group for v in c.trained_versions()), default=None)


class GeneratorExecutor:
    def __init__(
        self,
        rollout,
        max_running: int,
        seed: int,
        backend: GeneratorBackend,
        prompts,
        stop_ids,
        replica: int,
        groups_per_step: int,
        tp_rank: int = 0,
        tp_group=None,
    ):
        """``rollout``: the config's RolloutConfig section; ``prompts``: tokenized prompts;
        ``groups_per_step``: this replica's share of a batch."""
        self.rollout, self.max_running, self.seed = rollout, max_running, seed
        self.groups_per_step = groups_per_step
        self.backend = backend
        self.replica, self.tp_rank, self.tp_group = replica, tp_rank, tp_group
        # every TP rank of a replica draws the same prompts in the same order
        self.stream = PromptStream(prompts, seed=seed * 1000 + replica)
        self.stop_ids = tuple(stop_ids)
        self.groups: Dict[int, List[Completion]] = {}  # finished samples of groups not yet complete
        self.pending: Dict[int, _InFlight] = {}  # groups with samples still in the backend
        self.in_flight = 0  # samples submitted and not yet returned
        self.next_group = 0
        self.ready: List[List[Completion]] = []  # finished groups not yet handed over, in the order they finished
        self.oldest: Dict[int, Optional[int]] = {}  # group id -> _oldest, of each group in ready (read every step)
        self.stale_dropped = 0
        self.lag_counts = empty_lag_counts()
        # group id -> prompt index of every group not yet handed over (or dropped): a checkpoint
        # lists them so that a resumed run generates them again
        self.prompt_of: Dict[int, int] = {}
        self.requeued: List[tuple] = []  # (group id, prompt index) to redo first, from a checkpoint
        # called before every backend step, with True while idle for the trainer (the heartbeat)
        self.on_step = lambda waiting=False: None
        self.eval_done: List[Completion] = []

    @property
    def version(self) -> int:
        return int(self.backend.stats()["version"] or 0)

    def _request(self) -> GenerationRequest:
        if self.requeued:  # a resumed run first redoes what was in flight at the checkpoint
            gid, index = self.requeued.pop(0)
            return self._make_request(gid, index, self.stream.items[index])
        prompt = next(self.stream)
        gid = self.next_group * 1_000 + self.replica  # unique over replicas
        self.next_group += 1
        return self._make_request(gid, self.stream.last_index, prompt)

    def _make_request(self, gid: int, index: int, prompt) -> GenerationRequest:
        r = self.rollout
        self.prompt_of[gid] = index
        params = SamplingParams(
            temperature=r.temperature,
            top_p=r.top_p,
            max_new_tokens=r.max_new_tokens,
            stop_token_ids=self.stop_ids,
            seed=sampling_seed(self.seed, gid),
        )
        return GenerationRequest(
            f"g{gid}",
            list(prompt.ids),
            params,
            n=r.samples_per_prompt,
            group_id=gid,
            # the messages: for an agent's episode (rollout.agent), which gets the prompt as chat messages
            meta={"answer": prompt.record.answer, **prompt.record.meta, "messages": prompt.record.messages},
        )

    def _submit(self, requests: List[GenerationRequest]) -> None:
        version = self.version
        for req in requests:
            self.pending[req.group_id] = _InFlight(req.request_id, version)
            self.in_flight += req.n
        self.backend.submit(requests)

    def _admission_cap(self, train_version: int, missing: int) -> int:
        """How many groups may be ready or in flight: what the batches that could train a group
        started now within max_lag hold -- batch ``train_version`` its ``missing`` groups, each
        later one up to version + max_lag ``groups_per_step`` (0 where no batch could)."""
        later = self.version + self.rollout.max_lag - train_version
        return missing + self.groups_per_step * later if later >= 0 else 0

    def _keep_full(self, admit_until: int = 1 << 62) -> bool:
        """Every slot busy, and one group queued so that freed slots refill at once -- while the
        groups ready or in flight number fewer than ``admit_until``. True: that cap kept a slot empty."""
        while self.in_flight <= self.max_running:
            if len(self.ready) + len(self.pending) >= admit_until:
                return True
            self._submit([self._request()])
        return False

    def _step_backend(self) -> None:
        """One backend step; finished samples join their group, complete groups wait in ``ready``."""
        n = self.rollout.samples_per_prompt
        self.on_step()
        for c in self.backend.step():
            self.in_flight -= 1
            if c.group_id < 0:  # an evaluation request (run_alongside), never a training group
                self.eval_done.append(c)
                continue
            entry = self.pending[c.group_id]
            entry.returned += 1
            if entry.returned == n:
                del self.pending[c.group_id]
            if c.finish_reason == ABORTED:
                raise MegarlError(
                    f"generator replica {self.replica}: sample {c.request_id}#{c.sample_index} was "
                    f"aborted although megarl did not abort it"
                )
            group = self.groups.setdefault(c.group_id, [])
            group.append(c)
            if len(group) == n:
                del self.groups[c.group_id]
                self.ready.append(sorted(group, key=lambda x: x.sample_index))
                self.oldest[c.group_id] = _oldest(group)

    def generate(self, train_version: int, n_groups: int, drain: bool) -> GeneratedGroups:
        """Groups for the trainer, and this replica's timing.

        ``drain`` (sync mode): submit exactly n_groups prompts and run them to the end.
        """
        start = time.perf_counter()
        if drain:
            self._submit([self._request() for _ in range(n_groups)])
        while True:
            batch = self._take(train_version, n_groups, drain)
            if batch is not None:
                break
            held = False
            if not drain:
                # never below the missing groups, so that the batch can always be filled: the cap is
                # smaller only where train_version overstates the trainer's version (skipped steps)
                held = self._keep_full(max(self._admission_cap(train_version, n_groups), n_groups))
            self.lag_counts["lag_admission_waits"] += held
            self._step_backend()
        return self._hand_over(batch, start)

    def _take(self, train_version: int, n_groups: int, drain: bool) -> Optional[List[List[Completion]]]:
        """The ``n_groups`` groups to hand over now, or None to step the backend first."""
        if drain:  # the batch in group order, not in the engine's slot order (which a restart changes)
            if len(self.ready) < n_groups:
                return None
            self.ready.sort(key=lambda g: g[0].group_id)
            return self.ready[:n_groups]
        if self.rollout.max_lag_policy == "drop":
            self._drop_stale(train_version)
        if len(self.ready) < n_groups:
            return None
        deadlines = [self._deadline(self.oldest[g[0].group_id]) for g in self.ready]
        order = sorted(range(len(self.ready)), key=lambda i: (deadlines[i], i))  # oldest first, then as finished
        if self.rollout.max_lag_policy == "wait" and self._must_wait(
            train_version, [deadlines[i] for i in order[:n_groups]], [deadlines[i] for i in order[n_groups:]]
        ):
            self.lag_counts["lag_handover_waits"] += 1
            return None
        return [self.ready[i] for i in order[:n_groups]]

    def _deadline(self, oldest: Optional[int]) -> float:
        """The last batch that can train a group whose oldest trained token is of version ``oldest``."""
        return math.inf if oldest is None else oldest + self.rollout.max_lag

    def _must_wait(self, train_version: int, taken: List[float], ready_rest: List[float]) -> bool:
        """max_lag_policy=wait: whether handing over the groups of deadlines ``taken`` now would
        leave more groups due by some batch d than batches train_version + 1 .. d hold (an earliest-
        deadline-first check over the groups left: ready ones, and those in flight by the version
        they were submitted under, which no token of theirs is older than). Waiting helps only for
        a group in flight due before one taken; without one, the groups taken are the earliest due."""
        in_flight = [self._deadline(e.submitted_version) for e in self.pending.values()]
        if not any(d < max(taken) for d in in_flight):
            return False
        left = sorted(ready_rest + in_flight)
        return any(k + 1 > self.groups_per_step * (d - train_version) for k, d in enumerate(left))

    def _drop_stale(self, train_version: int) -> None:
        """max_lag_policy=drop: finished groups whose oldest trained token is past the bound."""
        kept = []
        for group in self.ready:
            oldest = self.oldest[group[0].group_id]
            if oldest is None or train_version - oldest <= self.rollout.max_lag:
                kept.append(group)
                continue
            self.stale_dropped += 1  # too old to train on: dropped, a fresh prompt takes its slot
            self.lag_counts["lag_dropped_groups"] += 1
            for c in group:
                self.lag_counts[
                    f"lag_dropped_samples_{length_bucket(len(c.output_ids), self.rollout.max_new_tokens)}"
                ] += 1
            self.prompt_of.pop(group[0].group_id, None)
            del self.oldest[group[0].group_id]
        self.ready = kept

    def _hand_over(self, groups: List[List[Completion]], start: float) -> GeneratedGroups:
        taken = {id(g) for g in groups}
        self.ready = [g for g in self.ready if id(g) not in taken]
        for group in groups:
            self.prompt_of.pop(group[0].group_id, None)
            del self.oldest[group[0].group_id]
        counts, self.lag_counts = self.lag_counts, empty_lag_counts()
        return GeneratedGroups(
            groups=groups,
            time_generate=time.perf_counter() - start,
            engine_version=self.version,
            stale_dropped=self.stale_dropped,
            in_flight=self.in_flight,
            lag_counts=counts,
        )

    def generate_until(self, stop, next_train_version: int) -> int:
        """Keep decoding (groups that finish wait for the next batch) until ``stop()`` says the
        trainer is done: PipelineRL's generator never idles while the trainer works. The
        replica's first rank decides; its TP peers follow, so all run the same steps."""
        steps = 0
        while True:
            flag = torch.tensor([1 if (self.tp_rank == 0 and stop()) else 0])
            if self.tp_group is not None:
                dist.broadcast(flag, group=self.tp_group, group_src=0)
            if flag.item():
                return steps
            if self.rollout.max_lag_policy == "drop":
                self._drop_stale(next_train_version)  # its place goes to a fresh prompt now
            held = self._keep_full(self._admission_cap(next_train_version, self.groups_per_step))
            if self.in_flight:
                self.lag_counts["lag_admission_waits"] += held
                self._step_backend()
            else:
                self.on_step(True)  # quiet by design: waiting for the trainer
                time.sleep(0.01)  # ahead of the trainer: nothing useful to start
            steps += 1

    def finish_in_flight(self) -> None:
        """Run every sequence in the backend to its end (generator.inflight_updates=false: before a
        weight update, so that no sample holds tokens of two policies). Groups that finish wait in
        ``ready`` for the next batch, under admission control as usual."""
        while self.in_flight:
            self._step_backend()

    # -- evaluation ----------------------------------------------------------------------------

    def run_alongside(self, requests: List[GenerationRequest]) -> List[Completion]:
        """Decode ``requests`` (an evaluation's: negative group ids, executors/evaluation.py) alongside
        the training groups in flight, which go on and finish as usual: the engine never drains.
        Returns every completion of them."""
        total = sum(req.n for req in requests)
        self.eval_done = []
        self.in_flight += total
        self.backend.submit(requests)
        while len(self.eval_done) < total:
            self._step_backend()
        done, self.eval_done = self.eval_done, []
        return done

    # -- checkpointing -------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """What a checkpoint needs to continue this replica's prompt stream exactly.

        Groups generated but not handed to the trainer -- in flight, partly finished, or
        ready -- cannot be saved (their KV caches live in the engine); they are listed by
        group id and prompt, and a resumed run generates them again from the start, under
        the checkpoint's policy, with the same group ids and sampling seeds, before any new
        prompt. In sync mode nothing is ever in flight at a step boundary.
        """
        redo = sorted(self.prompt_of.items())
        return {
            "stream": self.stream.state_dict(),
            "next_group": self.next_group,
            "requeue": [list(x) for x in redo + self.requeued],
            "stale_dropped": self.stale_dropped,
        }

    def load_state_dict(self, state: dict) -> None:
        self.stream.load_state_dict(state["stream"])
        self.next_group = state["next_group"]
        self.requeued = [tuple(x) for x in state["requeue"]]
        # checkpoints from before max_lag_policy also hold "stale_aborted" (groups in flight aborted
        # by the version they were submitted under, which nothing does any more): not read
        self.stale_dropped = state["stale_dropped"]

    def close(self) -> None:
        self.backend.close()
