"""The run's layout: what run.mode and generator.backend mean for the ranks, decided here alone.

torchtitan's ParallelDims owns every size derived from the parallel degrees; ``RunLayout`` is the
same for the whole job, one level up: built from the trainer's ParallelDims, the generators'
GeneratorDims (megarl/parallel_dims.py) and the two switches, it owns the job's world size, the
lag bound and the ``Topology`` -- which global rank runs which executor, every process group's
members, and the channels. Config (``cfg.layout()``), the planner and its dry run, the trainer's
feature checks and the wiring ask it; none of them reads run.mode for the ranks again.

LlamaRL (arXiv 2505.24034, section 5): executors -- trainer, generator, reward -- each own a set of
ranks with their own parallelism; channels move data between them. Pure Python (no torch): the same
object drives a run and ``megarl plan --dry-run-topology`` for 1024 ranks on a laptop.

    disaggregated   trainer ranks [0, T), generator ranks [T, T + G) (async mode); each generator
                    replica's TP rank 0 also runs the reward executor on its samples
    colocated       every rank runs trainer, generator (a TP-1 engine over a copy of the weights)
                    and reward, alternating (sync mode)

Every rank formula is megarl.parallel_dims': trainer ranks in Megatron-Core's order (tp
fastest, then cp, dp, pp), so TP groups are consecutive ranks and stay within a node;
generator ranks replica-major.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Tuple

from megarl.errors import ConfigError
from megarl.parallel_dims import GeneratorDims, ParallelDims

MODES = ("async", "sync")  # run.mode: config.py refuses any other
BACKENDS = ("torch", "sglang")  # generator.backend: ... and any other
SERVER_BACKENDS = ("sglang",)  # generators that are servers with workers of their own, not engine ranks


def disaggregated_world_size(trainer: ParallelDims, generator: GeneratorDims) -> int:
    """Ranks of a world where the generators' ranks follow the trainer's: the job's in async mode,
    and the weight-sync group (SGLang's workers included) in every mode that has one."""
    return trainer.world_size + generator.world_size


@dataclass(frozen=True)
class RunLayout:
    """The job as run.mode and generator.backend lay it out (``Config.layout()`` builds it)."""

    mode: str  # run.mode
    backend: str  # generator.backend
    trainer: ParallelDims
    generator: GeneratorDims  # as configured (async); colocated runs one TP-1 engine per trainer rank instead
    max_lag: int  # rollout.max_lag (async)
    updates_per_batch: int  # trainer.updates_per_batch (sync)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ConfigError(f"run.mode: {self.mode!r} is not one of {list(MODES)}")
        if self.backend not in BACKENDS:
            raise ConfigError(f"generator.backend: {self.backend!r} is not one of {list(BACKENDS)}")

    @property
    def colocated(self) -> bool:
        """Generation and training alternate on every rank (sync mode)."""
        return self.mode == "sync"

    @property
    def server_generators(self) -> bool:
        """The generators are servers with workers of their own (SGLang), not engines in this process."""
        return self.backend in SERVER_BACKENDS

    @property
    def world_size(self) -> int:
        """GPUs (ranks) of the job: trainer + generators (async; SGLang servers' GPUs included),
        or the trainer's alone (sync, colocated)."""
        if self.colocated:
            return self.trainer.world_size
        return disaggregated_world_size(self.trainer, self.generator)

    @property
    def lag_bound(self) -> int:
        """The most policy versions a trained token may lag: generation and training alternate in
        sync mode, so every token is of the policy that trains on it -- but for the G-1 steps a batch
        of trainer.updates_per_batch = G slices waits for its last slice."""
        return self.updates_per_batch - 1 if self.colocated else self.max_lag

    @property
    def steps_ahead(self) -> int:
        """Steps of generation a replica may run ahead of the trainer (what caps sequences in flight,
        as the planner prices it): rollout.max_lag in async mode, one step in sync mode."""
        return 1 if self.colocated else max(self.max_lag, 1)

    def topology(self) -> "Topology":
        """The ranks of the run (also the dry run's, plan/dry_run.py)."""
        if self.colocated:
            return Topology.colocated_on(self.trainer)
        return Topology.disaggregated(self.trainer, self.generator, drivers_only=self.server_generators)


BROADCAST, SCATTER, GATHER, WEIGHTS = "BROADCAST", "SCATTER", "GATHER", "WEIGHTS"


@dataclass(frozen=True)
class ChannelSpec:
    name: str
    kind: str  # BROADCAST | SCATTER | GATHER | WEIGHTS
    sender: str  # executor names
    receiver: str
    src: Tuple[int, ...]  # global ranks that send
    dst: Tuple[int, ...]  # global ranks that receive


@dataclass
class Topology:
    world_size: int
    executors: Dict[str, Tuple[int, ...]]
    trainer: ParallelDims
    generator: GeneratorDims  # colocated: one TP-1 engine per trainer rank
    colocated: bool  # the generators run on the trainer's ranks (sync mode)
    # a replica's first rank drives a server whose own workers hold its TP shards (SGLang); the
    # replica's other ranks stand by. False: every generator rank runs an engine shard (torch)
    drivers_only: bool = False
    channels: List[ChannelSpec] = field(default_factory=list)

    # -- construction ----------------------------------------------------------------------

    @classmethod
    def disaggregated(cls, trainer: ParallelDims, generator: GeneratorDims, drivers_only: bool = False) -> "Topology":
        world = disaggregated_world_size(trainer, generator)
        ranks = tuple(range(trainer.world_size))
        gen = tuple(range(trainer.world_size, world))
        return cls._with_channels(world, ranks, gen, trainer, generator, False, drivers_only)

    @classmethod
    def colocated_on(cls, trainer: ParallelDims) -> "Topology":
        ranks = tuple(range(trainer.world_size))
        return cls._with_channels(
            trainer.world_size, ranks, ranks, trainer, GeneratorDims(1, trainer.world_size), True, False
        )

    @classmethod
    def _with_channels(cls, world, trainer_ranks, generator_ranks, trainer, generator, colocated, drivers_only):
        leaders = generator_ranks[:: generator.tp]
        topo = cls(
            world,
            {"trainer": trainer_ranks, "generator": generator_ranks, "reward": leaders},
            trainer,
            generator,
            colocated,
            drivers_only,
        )
        topo.channels = [
            # finished, scored groups of every replica to the trainer's first rank ...
            ChannelSpec("rollouts", GATHER, "reward", "trainer", leaders, (trainer_ranks[0],)),
            # ... which gives every trainer rank the whole batch (each takes its DP shard)
            ChannelSpec("batch", BROADCAST, "trainer", "trainer", (trainer_ranks[0],), trainer_ranks),
            # the updated policy, shard to shard (weight_sync) or copied in place (sync mode)
            ChannelSpec("weights", WEIGHTS, "trainer", "generator", trainer_ranks, generator_ranks),
        ]
        return topo

    # -- membership --------------------------------------------------------------------------

    def roles(self, rank: int) -> List[str]:
        return [name for name, ranks in self.executors.items() if rank in ranks]

    def has(self, rank: int, role: str) -> bool:
        return rank in self.executors[role]

    @property
    def first_trainer_rank(self) -> int:
        return self.executors["trainer"][0]

    def trainer_groups(self) -> Dict[str, List[List[int]]]:
        first = self.first_trainer_rank
        return {k: [[first + r for r in g] for g in self.trainer.groups(k)] for k in ("tp", "dp", "pp")}

    def generator_tp_groups(self) -> List[List[int]]:
        gen = self.executors["generator"]
        return [[gen[i] for i in g] for g in self.generator.tp_groups()]

    def replica_of(self, rank: int) -> Tuple[int, int]:
        """(replica, tp_rank) of a generator rank."""
        return self.generator.replica_of(self.executors["generator"].index(rank))

    def runs_generator(self, rank: int) -> bool:
        """Whether this rank runs a generator executor (every engine-shard rank; a server's driver)."""
        if rank not in self.executors["generator"]:
            return False
        return not self.drivers_only or self.replica_of(rank)[1] == 0

    def channel(self, name: str) -> ChannelSpec:
        for c in self.channels:
            if c.name == name:
                return c
        raise KeyError(name)

    # -- checks (also the dry run's) ---------------------------------------------------------

    def check(self, gpus_per_node: int = 8) -> List[str]:
        """Raise ConfigError on a broken assignment; return the checks that passed."""
        passed = []
        seen: Dict[int, str] = {}
        primary = ("trainer",) if self.colocated else ("trainer", "generator")
        for name in primary:
            for rank in self.executors[name]:
                if rank in seen:
                    raise ConfigError(f"rank {rank} is in both {seen[rank]} and {name}")
                seen[rank] = name
        if sorted(seen) != list(range(self.world_size)):
            missing = sorted(set(range(self.world_size)) - set(seen))
            raise ConfigError(f"ranks {missing[:8]} belong to no executor (world size {self.world_size})")
        passed.append(f"every one of {self.world_size} ranks is in exactly one executor")
        for kind, groups in [("trainer TP", self.trainer_groups()["tp"]), ("generator TP", self.generator_tp_groups())]:
            for group in groups:
                if len({r // gpus_per_node for r in group}) > 1:
                    raise ConfigError(f"{kind} group {group} spans nodes ({gpus_per_node} GPUs per node)")
            passed.append(f"{len(groups)} {kind} groups, each within one node")
        for c in self.channels:
            if not set(c.src) <= set(self.executors[c.sender]) or not set(c.dst) <= set(self.executors[c.receiver]):
                raise ConfigError(f"channel {c.name}: its ranks are not those of {c.sender} -> {c.receiver}")
        passed.append(f"{len(self.channels)} channels connect the ranks of their executors")
        return passed

    def describe(self) -> dict:
        groups = self.trainer_groups()
        return {
            "placement": "colocated" if self.colocated else "disaggregated",
            "world_size": self.world_size,
            "executors": {k: rank_ranges(v) for k, v in self.executors.items()},
            "trainer": self.trainer.describe(),
            "generator": self.generator.describe() + (" (servers: driver ranks only)" if self.drivers_only else ""),
            "groups": {
                "trainer_tp": len(groups["tp"]),
                "trainer_dp": len(groups["dp"]),
                "trainer_pp": len(groups["pp"]),
                "generator_tp": len(self.generator_tp_groups()),
            },
            "channels": [
                f"{c.name}: {c.kind} {c.sender}{rank_ranges(c.src)} -> {c.receiver}{rank_ranges(c.dst)}"
                for c in self.channels
            ],
        }


def rank_ranges(ranks) -> str:
    """[0-3,8,10-11]: a set of ranks, short."""
    ranks = sorted(ranks)
    if not ranks:
        return "[]"
    out, start, prev = [], ranks[0], ranks[0]
    for r in ranks[1:] + [None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return "[" + ",".join(out) + "]"
