"""megarl's reference generator: continuous batching over an SGLang-layout Llama.

Up to ``max_running`` sequences in flight, each in a KV-cache slot
(preallocated, bounded by max_running x max_seq_len). Every ``step()``:
admit waiting samples into free slots and prefill them together (one ragged
forward), then decode one token for every other running sequence (one batched
forward), sample, and retire the finished ones -- so a short prompt finishes
and frees its slot while long ones keep going, and new prompts start at once.

Every token records the policy version of the weights that produced it.
``update_weights`` runs between steps: the new weights land in the same
tensors (weight sync or a load), later tokens carry the version that landed;
the KV cache of earlier tokens is kept, or recomputed under the new weights
when ``recompute_kv_on_update`` (PipelineRL's two options). ``abort`` frees
the slots of the named requests at once; their samples come back from the
next ``step()`` with finish_reason "abort".

Sessions (an episode's turns, ``GenerationRequest.session_id``): a finished turn's slot is
parked with the keys and values of every id it fed, and the session's next request, whose prompt
extends that context by the environment's ids, takes the slot back wherever it waits in the queue
and prefills only the new ids (``Completion.cached_tokens`` counts the reused ones). A parked slot
holds one of ``max_running``: a waiting sequence that finds no free slot takes the slot of the
session parked longest, once that one has been parked ``kv_park_timeout_s`` (a tool that runs for
a minute does not hold a slot for a minute; the evicted session's next turn prefills its whole
context, as without parking; counted in ``kv_evictions``). ``release_sessions`` frees the slots
of episodes that ended. Weights that land while a session is parked treat its cache as a running
sequence's: kept, or dropped under ``recompute_kv_on_update`` (the next prefill recomputes it).

Tensor parallel: every rank of the engine's group runs the same schedule on
the same requests; logits are all-gathered, so every rank samples the same
tokens with the same seeded generators and no token broadcast is needed.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, List, Optional, Sequence, Tuple

import torch

from megarl.errors import ConfigError
from megarl.generator.interface import ABORTED, Completion, GenerationRequest, GeneratorBackend
from megarl.generator.sampling import sample
from megarl.generator.torch_engine.model import KVCache, Segment, SglangLayoutModel
from megarl.models.families import refuse_outside_trainer
from megarl.models.spec import ModelSpec
from megarl.runtime.cpu_memory import keep_freed_memory


@dataclass
class _Sequence:
    request: GenerationRequest
    index: int
    slot: int = -1
    tokens: List[int] = field(default_factory=list)  # prompt + output
    cached: int = 0  # tokens whose keys/values are in the cache
    prompt_cached: int = 0  # prompt tokens whose keys/values a parked session left (not prefilled)
    output: List[int] = field(default_factory=list)
    logprobs: List[float] = field(default_factory=list)
    versions: List[int] = field(default_factory=list)
    generator: Optional[torch.Generator] = None


@dataclass
class _Parked:
    slot: int
    tokens: List[int]  # the ids whose keys and values the slot holds, in position order
    since: float  # time.perf_counter() when it was parked


def _common_prefix(a: List[int], b: List[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class TorchEngine(GeneratorBackend):
    def __init__(
        self,
        spec: ModelSpec,
        params: Dict[str, torch.Tensor],
        max_running: int = 64,
        max_seq_len: int = 2048,
        tp: int = 1,
        tp_rank: int = 0,
        group=None,
        recompute_kv_on_update: bool = False,
        version: int = 0,
        linear_path: str = "auto",
        cpu_kernels: str = "auto",
        ep: int = 1,
        kv_park_timeout_s: float = 1.0,
    ):
        refuse_outside_trainer(spec.model_type, "the torch engine")
        self.spec = spec
        if params["model.norm.weight"].device.type == "cpu":
            keep_freed_memory()  # a CPU engine's per-step logits reuse the heap (runtime/cpu_memory.py)
        self.model = SglangLayoutModel(
            spec,
            params,
            tp,
            tp_rank,
            group,
            decode_rows=max_running,
            linear_path=linear_path,
            cpu_kernels=cpu_kernels,
            ep=ep,
        )
        self.params = params
        self.cache = KVCache(
            spec.num_layers,
            max_running,
            self.model.kv_heads,
            max_seq_len,
            spec.head_dim,
            self.model.dtype,
            self.model.device,
        )
        # Routed experts of every position fed to the model, per slot ([position, layer, top_k], -1 on
        # dense layers), as SGLang records them for --enable-return-routed-experts: a position's routes
        # are those of the forward that last wrote its keys (prefill, decode or a recompute after an update).
        self.routes = (
            torch.full((max_running, max_seq_len, spec.num_layers, spec.moe.top_k), -1, dtype=torch.int16)
            if spec.moe is not None
            else None
        )
        self.max_seq_len = max_seq_len
        self.free_slots = list(range(max_running))[::-1]
        self.waiting: Deque[_Sequence] = deque()
        self.running: Dict[int, _Sequence] = {}
        self.parked: "OrderedDict[str, _Parked]" = OrderedDict()  # session -> its slot, parked longest ago first
        self.kv_park_timeout_s = kv_park_timeout_s
        self.version = version
        self.recompute_kv_on_update = recompute_kv_on_update
        self.paused = False
        self.aborted: List[Completion] = []  # returned by the next step()
        self.generated_tokens = 0
        self.prefill_tokens = 0  # prompt ids fed by a prefill
        self.cached_tokens = 0  # prompt ids a parked session's cache spared the prefill
        self.kv_evictions = 0  # parked sessions evicted for a sequence that found no free slot
        self.busy_seconds = 0.0

    # -- interface -------------------------------------------------------------------------------

    def submit(self, requests: List[GenerationRequest]) -> None:
        for r in requests:
            r.params.validate()
            if len(r.prompt_ids) + 1 > self.max_seq_len:
                raise ConfigError(
                    f"request {r.request_id}: prompt of {len(r.prompt_ids)} tokens does not fit "
                    f"max_seq_len={self.max_seq_len}"
                )
            if r.session_id is not None and r.n != 1:
                raise ConfigError(
                    f"request {r.request_id}: session {r.session_id} asks for n={r.n}; sessions are one sample"
                )
            for i in range(r.n):
                g = None
                if r.params.seed is not None:
                    # on the host, whatever the model's device: the sampler draws each row's uniform
                    # there and moves the batch's in one copy (sampling.draw), not one launch a row
                    g = torch.Generator().manual_seed(r.params.seed + i)
                self.waiting.append(_Sequence(r, i, tokens=list(r.prompt_ids), generator=g))

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    def update_weights(self, apply: Callable[[], object]):
        stats = apply()
        self.model.kernels.repack()  # the weights changed in place
        self.version = int(stats.version)
        if self.recompute_kv_on_update:
            self.release_sessions(list(self.parked))  # their next turns prefill under the new weights
            if self.running:
                seqs = list(self.running.values())
                self._forward([(s, 0, s.cached) for s in seqs], want_logits=False)
        return stats

    def release_sessions(self, session_ids: Sequence[str]) -> None:
        for session in session_ids:
            parked = self.parked.pop(session, None)
            if parked is not None:
                self.free_slots.append(parked.slot)

    def abort(self, request_ids: Sequence[str]) -> None:
        doomed = set(request_ids)
        for seq in [s for s in self.waiting if s.request.request_id in doomed]:
            self.waiting.remove(seq)
            self.aborted.append(self._completion(seq, ABORTED))
        for seq in [s for s in self.running.values() if s.request.request_id in doomed]:
            self.aborted.append(self._retire(seq, ABORTED))

    def stats(self) -> Dict[str, float]:
        return {
            "queue_depth": len(self.waiting),
            "running": len(self.running),
            "generated_tokens": self.generated_tokens,
            "tokens_per_s": self.generated_tokens / self.busy_seconds if self.busy_seconds else 0.0,
            "version": self.version,
            "kv_cache_bytes": self.cache.nbytes(),
            "kv_parked": len(self.parked),
            "kv_evictions": self.kv_evictions,
            "prefill_tokens": self.prefill_tokens,
            "cached_tokens": self.cached_tokens,
        }

    def step(self) -> List[Completion]:
        finished, self.aborted = self.aborted, []
        if self.paused:
            return finished
        start = time.perf_counter()
        admitted = self._admit_waiting()
        # in slot order, so consecutive slots let the decode read the cache as a view
        decoding = sorted((s for s in self.running.values() if s not in admitted), key=lambda s: s.slot)
        # One forward per step: the admitted prompts are prefilled (and their first token
        # sampled) in the same pass that decodes one token for every other sequence.
        work = [(s, s.cached, len(s.tokens) - s.cached) for s in admitted] + [(s, s.cached, 1) for s in decoding]
        if work:
            finished += self._advance([w[0] for w in work], work)
        self.busy_seconds += time.perf_counter() - start
        return finished

    # -- internals -------------------------------------------------------------------------------

    def _admit_waiting(self) -> List[_Sequence]:
        """Slots for waiting sequences: a session's next turn first takes its parked slot back (its
        cached prefix kept), then the queue in order takes free slots, then the slots of sessions
        parked at least kv_park_timeout_s, longest first."""
        admitted = []
        returning = [s for s in self.waiting if s.request.session_id in self.parked] if self.parked else []
        for seq in returning:  # scanned only while a session is parked: the plain path stays a popleft
            self.waiting.remove(seq)
            parked = self.parked.pop(seq.request.session_id)
            # the last prompt id is always fed: its logits sample the first new token
            self._place(seq, parked.slot, min(_common_prefix(parked.tokens, seq.tokens), len(seq.tokens) - 1))
            admitted.append(seq)
        while self.waiting and (self.free_slots or self._evict_stale()):
            seq = self.waiting.popleft()
            self._place(seq, self.free_slots.pop(), 0)
            admitted.append(seq)
        return admitted

    def _place(self, seq: _Sequence, slot: int, cached: int) -> None:
        seq.slot, seq.cached, seq.prompt_cached = slot, cached, cached
        self.cached_tokens += cached
        self.prefill_tokens += len(seq.tokens) - cached
        self.running[slot] = seq

    def _evict_stale(self) -> bool:
        """Free the slot of the session parked longest, if it has been parked kv_park_timeout_s."""
        if not self.parked:
            return False
        session, oldest = next(iter(self.parked.items()))
        if time.perf_counter() - oldest.since < self.kv_park_timeout_s:
            return False
        del self.parked[session]
        self.free_slots.append(oldest.slot)
        self.kv_evictions += 1
        return True

    def _forward(self, work: List[Tuple[_Sequence, int, int]], want_logits: bool = True) -> Optional[torch.Tensor]:
        """Feed tokens [start, start + length) of each sequence; logits of each one's last row."""
        tokens, positions, segments, last_rows = [], [], [], []
        for seq, start, length in work:
            segments.append(Segment(seq.slot, start, length, len(tokens)))
            tokens += seq.tokens[start : start + length]
            positions += range(start, start + length)
            last_rows.append(len(tokens) - 1)
            seq.cached = start + length
        device = self.model.device
        logits = self.model.forward(
            torch.tensor(tokens, device=device),
            torch.tensor(positions, device=device),
            segments,
            self.cache,
            torch.tensor(last_rows, device=device),
        )
        if self.routes is not None:
            step_routes = self.model.routes.cpu()  # one copy per step, after the forward: none per layer
            for (seq, start, length), segment in zip(work, segments):
                rows = step_routes[segment.offset : segment.offset + length]
                self.routes[seq.slot, start : start + length] = rows
        return logits if want_logits else None

    def _advance(self, seqs: List[_Sequence], work) -> List[Completion]:
        logits = self._forward(work)
        tokens, logprobs = sample(logits, [s.request.params for s in seqs], [s.generator for s in seqs])
        done = []
        for seq, token, logprob in zip(seqs, tokens, logprobs):
            seq.tokens.append(token)
            seq.output.append(token)
            seq.logprobs.append(logprob)
            seq.versions.append(self.version)
            self.generated_tokens += 1
            reason = None
            if token in seq.request.params.stop_token_ids:
                reason = "stop"
            elif len(seq.output) >= seq.request.params.max_new_tokens or len(seq.tokens) >= self.max_seq_len:
                reason = "length"
            if reason:
                done.append(self._retire(seq, reason))
        return done

    def _retire(self, seq: _Sequence, reason: str) -> Completion:
        del self.running[seq.slot]
        session = seq.request.session_id
        if session is not None and reason != ABORTED:  # the session's next turn extends this context
            self.parked[session] = _Parked(seq.slot, seq.tokens[: seq.cached], time.perf_counter())
        else:
            self.free_slots.append(seq.slot)
        routes = None
        if self.routes is not None:  # SGLang's [routed_experts_start_len = 0, seqlen - 1): every fed position
            routes = self.routes[seq.slot, : len(seq.tokens) - 1].clone()
        return self._completion(seq, reason, routes)

    @staticmethod
    def _completion(seq: _Sequence, reason: str, routes: Optional[torch.Tensor] = None) -> Completion:
        r = seq.request
        return Completion(
            r.request_id,
            seq.index,
            r.group_id,
            list(r.prompt_ids),
            seq.output,
            seq.logprobs,
            seq.versions,
            reason,
            dict(r.meta),
            routes,
            cached_tokens=seq.prompt_cached,
        )
