"""A generator backend whose samples are whole episodes: the loop's generator executor runs
multi-turn rollouts unchanged.

``MultiTurnBackend(inner, make_env, decode, settings)`` takes the executor's requests (a prompt,
``n`` samples) and runs each sample as an episode (episode.py): every turn is a request to the
``inner`` backend whose prompt is the episode's whole context, the environment's step runs in a
bounded thread pool while the inner backend keeps decoding the other episodes, and a finished
episode comes back as one :class:`Completion` of the original request: ``output_ids`` every
segment's ids in order, ``loss_mask`` 0 on the environment's, behaviour log-probs and versions
the sampler's (``MASKED_LOGPROB`` / ``MASKED_VERSION`` on the environment's), ``episode`` its
turns, tool calls and why it ended.

Policies, stated:

- KV cache: every turn of an episode is a request of its session (``session_id``, the episode
  id). megarl's torch engine parks the slot of a finished turn while the environment steps and
  prefills only the inserted ids at the next turn; SGLang's radix cache finds the prefix by itself.
  A parked slot counts against the engine's ``max_running``; a waiting sequence that finds no free
  slot takes the one parked longest, once it has been parked ``generator.kv_park_timeout_s`` (that
  episode's next turn prefills its whole context; counted as ``kv_evictions``). The slot is
  released when the episode ends, however it ends.
  The executor's admission (``generator.max_running``) counts a parked episode as one sample in
  flight; evictions come from samples queued beyond the engine's slots.
  ``episode_prompt_cached_frac`` is the share of the turns' prompt ids a cache kept.
- Weight updates go to the inner backend between steps and may land between or within turns: each
  token keeps the version that produced it, and ``rollout.max_lag`` judges an episode by its
  oldest trained token (``Completion.trained_versions``).
- Aborting a request aborts its episodes' turns in flight and drops their parked steps; each comes
  back ``ABORTED``, as the executor expects of any backend.
- An environment step past ``env_timeout_s`` or one that raises ends its episode (finish
  ``env_timeout`` / ``env_error``, counted in ``stats()``); the sample is kept with what it has,
  scored by the reward like any other. The job never waits on a stuck environment.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

from megarl.environments.episode import Environment, EpisodeSettings, StepResult, Trajectory, Turn
from megarl.generator.interface import ABORTED, Completion, GenerationRequest, GeneratorBackend, SamplingParams


@dataclass
class _Episode:
    request: GenerationRequest
    sample_index: int
    trajectory: Trajectory
    env: Environment
    future: Optional[Future] = None
    started: float = 0.0
    last_finish: str = ""
    turn_request: Optional[str] = None  # the turn in flight in the inner backend
    max_new_tokens: Optional[int] = None  # the next turn's own limit (StepResult.max_new_tokens)


def _reset(env: Environment, t: Trajectory) -> StepResult:
    out = env.reset(t)  # ids to insert, or a StepResult (an agent's first call: its max_tokens)
    return out if isinstance(out, StepResult) else StepResult(insert_ids=out)


class MultiTurnBackend(GeneratorBackend):
    def __init__(
        self,
        inner: GeneratorBackend,
        make_env: Callable[[int], Environment],
        decode: Callable[[List[int]], str],
        settings: EpisodeSettings = EpisodeSettings(),
        keep_trajectories: bool = False,
        on_close: Sequence[Callable[[], None]] = (),
    ):
        settings.validate()
        self.on_close = list(on_close)  # what serves the environments (an agent's endpoint)
        self.keep_trajectories = keep_trajectories
        self.inner, self.make_env, self.decode, self.settings = inner, make_env, decode, settings
        self.pool = ThreadPoolExecutor(max_workers=settings.env_workers, thread_name_prefix="megarl-env")
        self.live: Dict[str, _Episode] = {}  # episode id -> episode
        self.by_turn: Dict[str, str] = {}  # inner request id -> episode id
        self.done: List[Completion] = []
        self.trajectories: Dict[int, Trajectory] = {}  # id(completion) -> its trajectory (keep_trajectories)
        self.episode_count = 0
        self.counters: Dict[str, float] = {
            "episodes": 0,
            "turns": 0,
            "tool_calls": 0,
            "tool_errors": 0,
            "env_timeouts": 0,
            "env_errors": 0,
            "env_seconds": 0.0,
        }

    # -- GeneratorBackend ------------------------------------------------------------------------

    def submit(self, requests: List[GenerationRequest]) -> None:
        for r in requests:
            for k in range(r.n):
                episode_id = f"{r.request_id}#{k}"
                t = Trajectory(episode_id, list(r.prompt_ids), group_id=r.group_id, meta=dict(r.meta))
                e = _Episode(r, k, t, self.make_env(self.episode_count))
                self.episode_count += 1
                self.live[episode_id] = e
                # in the pool, like a step: an agent's reset waits for its first call
                e.started, e.future = time.perf_counter(), self.pool.submit(_reset, e.env, t)

    def step(self) -> List[Completion]:
        busy = bool(self.by_turn)
        for c in self.inner.step() if busy else []:
            e = self.live.get(self.by_turn.pop(c.request_id, ""))
            if e is not None:
                self._turn_done(e, c)
        self._collect()
        if not busy and self.live:
            time.sleep(0.001)  # only environment steps in progress: let them run
        done, self.done = self.done, []
        return done

    def abort(self, request_ids: Sequence[str]) -> None:
        doomed = set(request_ids)
        turns = []
        for e in list(self.live.values()):
            if e.request.request_id in doomed:
                if e.turn_request is not None:
                    turns.append(e.turn_request)
                    self.by_turn.pop(e.turn_request, None)
                if e.future is not None:
                    e.future.cancel()
                self._finish(e, "aborted")
        if turns:
            self.inner.abort(turns)  # their ABORTED completions come back from inner.step: ignored

    def update_weights(self, apply):
        return self.inner.update_weights(apply)

    def stats(self) -> Dict[str, float]:
        parked = sum(1 for e in self.live.values() if e.future is not None)
        return {**self.inner.stats(), **self.counters, "episodes_live": len(self.live), "episodes_parked": parked}

    def close(self) -> None:
        for close in self.on_close:
            close()
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.inner.close()

    def run_until_idle(self, max_steps: int = 1_000_000) -> List[Completion]:
        done: List[Completion] = []
        for _ in range(max_steps):
            done += self.step()
            if not self.live:
                return done
        raise RuntimeError(f"episodes still running after {max_steps} steps")

    def trajectory_of(self, completion: Completion) -> Trajectory:
        return self.trajectories[id(completion)]

    # -- episodes --------------------------------------------------------------------------------

    def _next_turn(self, e: _Episode) -> None:
        t = e.trajectory
        context = t.context()
        room = self.settings.max_context - len(context)
        if room <= 0:
            self._finish(e, "max_context")
            return
        p = e.request.params
        seed = None if p.seed is None else p.seed + 1000 * t.turns + e.sample_index  # a fresh stream per turn
        limit = p.max_new_tokens if e.max_new_tokens is None else min(p.max_new_tokens, e.max_new_tokens)
        params = SamplingParams(
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,
            max_new_tokens=min(limit, room),
            stop_token_ids=p.stop_token_ids,
            seed=seed,
        )
        e.turn_request = f"{t.episode_id}/turn{t.turns}"
        self.by_turn[e.turn_request] = t.episode_id
        self.inner.submit(
            [GenerationRequest(e.turn_request, context, params, group_id=t.group_id, session_id=t.episode_id)]
        )

    def _turn_done(self, e: _Episode, c: Completion) -> None:
        e.turn_request = None
        if c.finish_reason == ABORTED:  # not asked for by this backend's abort: the inner backend's
            self._finish(e, "aborted")
            return
        t = e.trajectory
        t.add_generated(c)
        t.turns += 1
        self.counters["turns"] += 1
        e.last_finish = c.finish_reason
        e.started = time.perf_counter()
        e.future = self.pool.submit(
            e.env.step, Turn(list(c.output_ids), self.decode(list(c.output_ids)), c.finish_reason)
        )

    def _collect(self) -> None:
        s = self.settings
        for e in list(self.live.values()):
            if e.future is None:
                continue
            t = e.trajectory
            waited = time.perf_counter() - e.started
            if not e.future.done():
                if waited > s.env_timeout_s:  # the thread may run on; the episode does not wait for it
                    e.future.cancel()
                    self.counters["env_timeouts"] += 1
                    t.env_seconds += waited
                    self._finish(e, "env_timeout")
                continue
            t.env_seconds += waited
            future, e.future = e.future, None
            try:
                result: StepResult = future.result()
            except Exception as exc:  # an environment bug ends its episode, named, not the job
                self.counters["env_errors"] += 1
                t.meta["env_error"] = f"{type(exc).__name__}: {exc}"
                self._finish(e, "env_error")
                continue
            t.reward += result.reward
            t.tool_calls += result.tool_calls
            t.tool_errors += result.tool_errors
            if result.done:  # a last turn cut by a token limit ends it as "length" (overlong handling)
                self._finish(e, "length" if e.last_finish == "length" and result.finish == "done" else result.finish)
            elif t.turns >= s.max_turns:
                self._finish(e, "max_turns")
            else:
                t.add_inserted(result.insert_ids)
                e.max_new_tokens = result.max_new_tokens
                self._next_turn(e)

    def _finish(self, e: _Episode, finish: str) -> None:
        t = e.trajectory
        t.finish = finish
        self.live.pop(t.episode_id, None)
        self.inner.release_sessions([t.episode_id])  # its parked cache, if the backend kept one
        close = getattr(e.env, "close", None)
        if close is not None:  # an agent's session ends: its pending call is answered with an error
            close()
        self.counters["episodes"] += 1
        self.counters["tool_calls"] += t.tool_calls
        self.counters["tool_errors"] += t.tool_errors
        self.counters["env_seconds"] += t.env_seconds
        sample = t.to_sample()
        c = Completion(
            e.request.request_id,
            e.sample_index,
            e.request.group_id,
            list(t.prompt_ids),
            sample.response_tokens,
            sample.behaviour_logprobs,
            sample.policy_versions,
            ABORTED if finish == "aborted" else sample.finish_reason,
            meta=dict(e.request.meta),
            loss_mask=sample.loss_mask,
            episode=sample.episode,
        )
        if self.keep_trajectories:
            self.trajectories[id(c)] = t
        self.done.append(c)
