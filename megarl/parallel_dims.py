"""The parallel dimensions of a job, and every rank formula derived from them, written once.

``ParallelDims`` is the trainer's (Megatron-Core): tensor, context, data and pipeline
parallel sizes, virtual pipeline stages, and expert / expert-tensor parallel sizes.
``GeneratorDims`` is the generators': each replica's tensor-parallel (and expert-parallel)
size and the number of replicas. Pure Python (no torch): the topology, Megatron's
initialisation, the weight-sync planner, the capacity planner and the 1024-rank dry run
all compute ranks here.

Rank orders are Megatron-Core's own (parallel_state.initialize_model_parallel, its default
``order="tp-cp-ep-dp-pp"`` and its RankGenerator), so a rank here is the rank Megatron
gives the same coordinates:

    dense    tp fastest, then cp, then dp, then pp       rank = tp + TP (cp + CP (dp + DP pp))
    expert   etp fastest, then ep, then edp, then pp     rank = etp + ETP (ep + EP (edp + EDP pp))

Expert parallelism is carved out of the dense layout: the same world of TP x CP x DP x PP
ranks is regrouped for the experts as ETP x EP x EDP x PP (EDP, the expert data parallel
size, is what is left), so ``ep`` and ``etp`` never multiply into the world size, and
``etp`` defaults to ``tp`` as in Megatron-Core. Groups (``groups("tp")``,
``expert_groups("ep")``, ...) list the ranks of every group of that kind in Megatron's order
(tests/unit/test_parallel_dims.py compares them with Megatron's RankGenerator).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from megarl.errors import ConfigError

DENSE_ORDER = ("tp", "cp", "dp", "pp")
EXPERT_ORDER = ("etp", "ep", "edp", "pp")


def _check_positive(section: str, values: Dict[str, int]) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{section}.{name}: must be an integer >= 1, got {value!r}")


def _rank(order: Sequence[int], coords: Sequence[int]) -> int:
    rank, stride = 0, 1
    for size, coord in zip(order, coords):
        if not 0 <= coord < size:
            raise ValueError(f"coordinate {coord} outside a dimension of size {size}")
        rank += coord * stride
        stride *= size
    return rank


def _coords(sizes: Sequence[int], rank: int) -> Tuple[int, ...]:
    out = []
    for size in sizes:
        rank, coord = divmod(rank, size)
        out.append(coord)
    return tuple(out)


def _groups(names: Sequence[str], sizes: Sequence[int], token: str) -> List[List[int]]:
    """Every group spanning the dimensions in ``token`` (e.g. "tp-pp"), in Megatron's order:
    groups enumerate the other dimensions (first fastest), a group's ranks its own (first fastest)."""
    wanted = token.split("-")
    unknown = [w for w in wanted if w not in names]
    if unknown:
        raise ValueError(f"no parallel dimension {unknown[0]!r} (known: {', '.join(names)})")
    inside = [i for i, n in enumerate(names) if n in wanted]
    outside = [i for i, n in enumerate(names) if n not in wanted]

    def combos(dims):  # first dimension fastest
        ranges = [range(sizes[i]) for i in reversed(dims)]
        return [tuple(reversed(c)) for c in itertools.product(*ranges)]

    out = []
    for o in combos(outside):
        group = []
        for i in combos(inside):
            coords = [0] * len(names)
            for d, c in zip(outside, o):
                coords[d] = c
            for d, c in zip(inside, i):
                coords[d] = c
            group.append(_rank(sizes, coords))
        out.append(group)
    return out


@dataclass(frozen=True)
class ParallelDims:
    """The trainer's parallelism, by Megatron-LM's short names (tensor/context/data/pipeline/
    expert/expert-tensor parallel sizes, virtual pipeline stages per PP rank)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    vpp: int = 1  # virtual pipeline stages per PP rank (interleaved 1F1B); 1 = not interleaved
    ep: int = 1
    etp: Optional[int] = None  # None: tp, Megatron-Core's default
    # the config section errors name ("trainer.tp: ..."); not a dimension
    section: str = field(default="trainer", compare=False, repr=False)

    def __post_init__(self) -> None:
        _check_positive(self.section, dict(tp=self.tp, pp=self.pp, dp=self.dp, cp=self.cp, vpp=self.vpp, ep=self.ep))
        if self.etp is not None:
            _check_positive(self.section, dict(etp=self.etp))
        if self.vpp > 1 and self.pp == 1:
            raise ConfigError(
                f"{self.section}.vpp={self.vpp}: virtual pipeline stages interleave a pipeline; "
                f"needs {self.section}.pp > 1"
            )
        expert_model = self.expert_tp * self.ep
        if (self.tp * self.cp * self.dp) % expert_model:
            raise ConfigError(
                f"{self.section}.ep={self.ep} x {self.section}.etp={self.expert_tp} = {expert_model} must divide "
                f"the {self.tp * self.cp * self.dp} ranks of a pipeline stage (tp x cp x dp): Megatron-Core carves "
                f"expert parallelism out of them"
            )

    # -- sizes ---------------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def edp(self) -> int:
        """Expert data parallel size: the ranks of a stage left over by ETP x EP."""
        return self.tp * self.cp * self.dp // (self.expert_tp * self.ep)

    @property
    def virtual_pipeline_model_parallel_size(self) -> Optional[int]:
        """Megatron-Core's argument: None when not interleaved."""
        return self.vpp if self.vpp > 1 else None

    @property
    def dense_sizes(self) -> Tuple[int, int, int, int]:
        return (self.tp, self.cp, self.dp, self.pp)

    @property
    def expert_sizes(self) -> Tuple[int, int, int, int]:
        return (self.expert_tp, self.ep, self.edp, self.pp)

    # -- ranks ---------------------------------------------------------------------------------

    def rank(self, tp_rank: int = 0, cp_rank: int = 0, dp_rank: int = 0, pp_rank: int = 0) -> int:
        """The trainer rank (0-based within the trainer) at these dense coordinates."""
        return _rank(self.dense_sizes, (tp_rank, cp_rank, dp_rank, pp_rank))

    def coords(self, rank: int) -> Dict[str, int]:
        """{"tp", "cp", "dp", "pp"} coordinates of a trainer rank."""
        self._check_rank(rank)
        return dict(zip(DENSE_ORDER, _coords(self.dense_sizes, rank)))

    def expert_rank(self, etp_rank: int = 0, ep_rank: int = 0, edp_rank: int = 0, pp_rank: int = 0) -> int:
        return _rank(self.expert_sizes, (etp_rank, ep_rank, edp_rank, pp_rank))

    def expert_coords(self, rank: int) -> Dict[str, int]:
        """{"etp", "ep", "edp", "pp"} coordinates of a trainer rank in the experts' layout."""
        self._check_rank(rank)
        return dict(zip(EXPERT_ORDER, _coords(self.expert_sizes, rank)))

    def groups(self, token: str) -> List[List[int]]:
        """Every dense group of a kind, e.g. "tp", "dp", "pp", "cp", "tp-pp" (model parallel),
        "dp-cp" (the gradient reduction's), as Megatron's RankGenerator lists them."""
        return _groups(DENSE_ORDER, self.dense_sizes, token)

    def expert_groups(self, token: str) -> List[List[int]]:
        """Every expert group of a kind: "ep", "etp", "edp", "etp-ep", ..."""
        return _groups(EXPERT_ORDER, self.expert_sizes, token)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside the trainer's {self.world_size} ranks")

    def describe(self) -> str:
        parts = [f"TP{self.tp}", f"PP{self.pp}"]
        parts += [f"CP{self.cp}"] if self.cp > 1 else []
        parts += [f"DP{self.dp}"]
        parts += [f"VPP{self.vpp}"] if self.vpp > 1 else []
        parts += [f"EP{self.ep}"] if self.ep > 1 else []
        parts += [f"ETP{self.expert_tp}"] if self.etp is not None and self.etp != self.tp else []
        return " x ".join(parts)


@dataclass(frozen=True)
class GeneratorDims:
    """The generators' parallelism: ``replicas`` engines, each over ``tp`` ranks (SGLang's
    tp_size); ``ep`` is SGLang's expert parallel size inside a replica's TP group."""

    tp: int = 1
    replicas: int = 1
    ep: int = 1
    section: str = field(default="generator", compare=False, repr=False)

    def __post_init__(self) -> None:
        _check_positive(self.section, dict(tp=self.tp, replicas=self.replicas, ep=self.ep))
        if self.tp % self.ep:
            raise ConfigError(
                f"{self.section}.ep={self.ep} must divide {self.section}.tp={self.tp} "
                f"(SGLang splits a replica's TP ranks into expert groups)"
            )

    @property
    def world_size(self) -> int:
        return self.tp * self.replicas

    def rank(self, replica: int, tp_rank: int) -> int:
        """A generator rank (0-based within the generators): replica-major, TP rank fastest."""
        if not 0 <= replica < self.replicas:
            raise ValueError(f"replica {replica} outside the {self.replicas} replicas")
        return _rank((self.tp, self.replicas), (tp_rank, replica))

    def replica_of(self, rank: int) -> Tuple[int, int]:
        """(replica, tp_rank) of a generator rank (0-based within the generators)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside the generators' {self.world_size} ranks")
        tp_rank, replica = _coords((self.tp, self.replicas), rank)
        return replica, tp_rank

    def tp_groups(self) -> List[List[int]]:
        return _groups(("tp", "replica"), (self.tp, self.replicas), "tp")

    def describe(self) -> str:
        return f"{self.replicas} x TP{self.tp}" + (f" (EP{self.ep})" if self.ep > 1 else "")


def generator_rank(trainer: ParallelDims, generator: GeneratorDims, replica: int, tp_rank: int) -> int:
    """A generator rank in a world where the generators follow the trainer: the job's world in
    async mode, and the weight-sync group (with SGLang's workers too) in every mode that has one."""
    return trainer.world_size + generator.rank(replica, tp_rank)
