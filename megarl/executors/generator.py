"""The generator executor: one generator replica's prompts, groups and admission control.

It talks only to a ``GeneratorBackend`` (generator/interface.py; built by
generator/factory.py from ``generator.backend``): megarl's torch engine in
this process (every TP rank of the replica runs this executor on the same
requests) or an SGLang server over HTTP (the replica's first rank runs it).
Everything here works the same for both:

``generate(train_version, n_groups)`` keeps the backend full -- up to
``generator.max_running`` samples in flight plus one group queued, so a freed
slot refills at once -- and returns the first ``n_groups`` prompt groups whose
samples have all finished. In async mode sequences still in flight stay in
the backend across steps (partial rollouts) and continue under each new
policy version; weights are replaced between decode steps by the weight
synchronizer (weight_sync/factory.py), never by draining the batch.

Admission control for ``rollout.max_lag``: a group is handed to the trainer
only if every token of it is at most ``max_lag`` versions behind the policy
that trains on it (``train_version``). A finished group that is older is
dropped (``stale_dropped``); a group still in flight whose first tokens were
already sampled too long ago can never qualify, so it is aborted at once and
its slots go to fresh prompts (``stale_aborted``). "Too long ago" uses the
backend's policy version when the group was submitted: its samples start at
once (the backend holds at most max_running + one group), so that is the
version of their first tokens.

While the trainer steps (``generate_until``), new prompts are admitted only
as long as the groups ready or in flight do not already cover every batch a
group started now could still join: with the backend at version v, a new
group can be trained up to version v + max_lag, i.e. by batches T' .. v +
max_lag (T' = the next batch's train version), ``groups_per_step`` each. A
generator faster than the trainer then stops early instead of making groups
that would only be dropped as stale; one slower than the trainer never
reaches the cap.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Dict, List, Set

import torch
import torch.distributed as dist

from megarl.data.datasets import PromptStream
from megarl.errors import MegarlError
from megarl.generator.interface import ABORTED, Completion, GenerationRequest, GeneratorBackend, SamplingParams


@dataclass
class GeneratedGroups:
    """What one ``generate`` call hands over: finished groups and the replica's counters."""

    groups: List[List[Completion]]
    time_generate: float  # seconds of this call
    engine_version: int  # the backend's policy version at hand-over
    stale_dropped: int  # running totals of the replica (admission control, see the module doc)
    stale_aborted: int
    in_flight: int  # samples still in the backend


@dataclass
class _InFlight:
    request_id: str
    submitted_version: int
    returned: int = 0  # samples back from the backend (finished or aborted)


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
        self.doomed: Set[int] = set()  # aborted groups whose samples are still coming back
        self.in_flight = 0  # samples submitted and not yet returned
        self.next_group = 0
        self.ready: List[List[Completion]] = []  # finished groups not yet handed over
        self.stale_dropped = 0
        self.stale_aborted = 0
        self.aborted_samples = 0
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
            seed=(self.seed * 7919 + gid) % (2**31),
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

    def _keep_full(self, admit_until: int = 1 << 62) -> None:
        """Every slot busy, and one group queued so that freed slots refill at once -- while the
        groups ready or in flight number fewer than ``admit_until``."""
        while self.in_flight <= self.max_running and len(self.ready) + len(self.pending) < admit_until:
            self._submit([self._request()])

    def _step_backend(self) -> None:
        """One backend step; finished samples join their group, complete groups wait in ``ready``."""
        n = self.rollout.samples_per_prompt
        self.on_step()
        for c in self.backend.step():
            self.in_flight -= 1
            if c.group_id < 0:  # an evaluation request (evaluate), never a training group
                self.eval_done.append(c)
                continue
            entry = self.pending[c.group_id]
            entry.returned += 1
            if entry.returned == n:
                del self.pending[c.group_id]
            if c.group_id in self.doomed:
                self.aborted_samples += c.finish_reason == ABORTED
                if entry.returned == n:
                    self.doomed.discard(c.group_id)
                continue
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

    def _abort_doomed(self, train_version: int) -> None:
        """Abort groups in flight that cannot be trained within max_lag (see the module doc)."""
        doomed = [
            gid
            for gid, entry in self.pending.items()
            if gid not in self.doomed and train_version - entry.submitted_version > self.rollout.max_lag
        ]
        if not doomed:
            return
        self.backend.abort([self.pending[gid].request_id for gid in doomed])
        for gid in doomed:
            self.doomed.add(gid)
            self.prompt_of.pop(gid, None)
            self.groups.pop(gid, None)  # its finished samples are useless without the rest
        self.stale_aborted += len(doomed)

    def generate(self, train_version: int, n_groups: int, drain: bool) -> GeneratedGroups:
        """Groups for the trainer, and this replica's timing.

        ``drain`` (sync mode): submit exactly n_groups prompts and run them to the end.
        """
        start = time.perf_counter()
        if drain:
            self._submit([self._request() for _ in range(n_groups)])
        else:
            self._abort_doomed(train_version)
        while True:
            self.ready = [g for g in self.ready if self._fresh(g, train_version, drain)]
            if len(self.ready) >= n_groups:
                break
            if not drain:
                self._keep_full()
            self._step_backend()
        if drain:  # the batch in group order, not in the engine's slot order (which a restart changes)
            self.ready.sort(key=lambda g: g[0].group_id)
        return self._hand_over(n_groups, start)

    def _hand_over(self, n_groups: int, start: float) -> "GeneratedGroups":
        ready, self.ready = self.ready[:n_groups], self.ready[n_groups:]
        for group in ready:
            self.prompt_of.pop(group[0].group_id, None)
        return GeneratedGroups(
            groups=ready,
            time_generate=time.perf_counter() - start,
            engine_version=self.version,
            stale_dropped=self.stale_dropped,
            stale_aborted=self.stale_aborted,
            in_flight=self.in_flight,
        )

    def generate_until(self, stop, next_train_version: int) -> int:
        """Keep decoding (groups that finish wait for the next batch) until ``stop()`` says the
        trainer is done: PipelineRL's generator never idles while the trainer works. The
        replica's first rank decides; its TP peers follow, so all run the same steps."""
        self._abort_doomed(next_train_version)
        # batches next_train_version .. version + max_lag can still take a group started now
        useful = self.groups_per_step * max(0, self.version + self.rollout.max_lag - next_train_version + 1)
        steps = 0
        while True:
            flag = torch.tensor([1 if (self.tp_rank == 0 and stop()) else 0])
            if self.tp_group is not None:
                dist.broadcast(flag, group=self.tp_group, group_src=0)
            if flag.item():
                return steps
            self._keep_full(admit_until=useful)
            if self.in_flight:
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

    def _fresh(self, group: List[Completion], train_version: int, drain: bool) -> bool:
        oldest = min(min(c.trained_versions(), default=train_version) for c in group)
        if drain or train_version - oldest <= self.rollout.max_lag:
            return True
        self.stale_dropped += 1  # too old to train on: dropped, a fresh prompt takes its slot
        self.prompt_of.pop(group[0].group_id, None)
        return False

    # -- evaluation ----------------------------------------------------------------------------

    def evaluate(self, tag: str, prompts, max_new_tokens: int, samples: int) -> List[List[Completion]]:
        """Per prompt: its greedy answer, then ``samples`` sampled ones when ``samples`` > 1 (seeded
        by prompt, so every evaluation draws the same random numbers). The requests decode alongside
        the training groups in flight (which go on and finish as usual): the engine never drains."""
        r = self.rollout
        requests = []
        for i, prompt in enumerate(prompts):
            meta = {"answer": prompt.record.answer, **prompt.record.meta, "messages": prompt.record.messages}
            greedy = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, stop_token_ids=self.stop_ids)
            requests.append(
                GenerationRequest(f"eval{tag}-{i}", list(prompt.ids), greedy, n=1, group_id=-1 - 2 * i, meta=meta)
            )
            if samples > 1:
                sampled = SamplingParams(
                    temperature=r.temperature,
                    top_p=r.top_p,
                    max_new_tokens=max_new_tokens,
                    stop_token_ids=self.stop_ids,
                    seed=(self.seed * 7919 + 104729 * i) % 2**31,
                )
                requests.append(
                    GenerationRequest(
                        f"eval{tag}-{i}s", list(prompt.ids), sampled, n=samples, group_id=-2 - 2 * i, meta=meta
                    )
                )
        total = sum(req.n for req in requests)
        self.eval_done = []
        self.in_flight += total
        self.backend.submit(requests)
        while len(self.eval_done) < total:
            self._step_backend()
        by_group: Dict[int, List[Completion]] = {}
        for c in self.eval_done:
            by_group.setdefault(c.group_id, []).append(c)
        self.eval_done = []
        out = []
        for i in range(len(prompts)):
            out.append(by_group[-1 - 2 * i] + sorted(by_group.get(-2 - 2 * i, []), key=lambda c: c.sample_index))
        return out

    # -- checkpointing -------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """What a checkpoint needs to continue this replica's prompt stream exactly.

        Groups generated but not handed to the trainer -- in flight, partly finished, or
        ready -- cannot be saved (their KV caches live in the engine); they are listed by
        group id and prompt, and a resumed run generates them again from the start, under
        the checkpoint's policy, with the same group ids and sampling seeds, before any new
        prompt. In sync mode nothing is ever in flight at a step boundary.
        """
        redo = sorted((gid, i) for gid, i in self.prompt_of.items() if gid not in self.doomed)
        return {
            "stream": self.stream.state_dict(),
            "next_group": self.next_group,
            "requeue": [list(x) for x in redo + self.requeued],
            "stale_dropped": self.stale_dropped,
            "stale_aborted": self.stale_aborted,
        }

    def load_state_dict(self, state: dict) -> None:
        self.stream.load_state_dict(state["stream"])
        self.next_group = state["next_group"]
        self.requeued = [tuple(x) for x in state["requeue"]]
        self.stale_dropped, self.stale_aborted = state["stale_dropped"], state["stale_aborted"]

    def close(self) -> None:
        self.backend.close()
