"""Which global rank runs which executor, every process group's members, and the channels.

LlamaRL (arXiv 2505.24034, section 5): executors -- trainer, generator,
reward -- each own a set of ranks with their own parallelism; channels move
data between them. Pure Python (no torch): the same object drives a run and
``megarl plan --dry-run-topology`` for 1024 ranks on a laptop.

    async   trainer ranks [0, T), generator ranks [T, T + G); each generator
            replica's TP rank 0 also runs the reward executor on its samples
    sync    every rank runs trainer, generator (a TP-1 engine over a copy of
            the weights, colocated) and reward, alternating

Trainer ranks are numbered as Megatron-Core's default order (tp fastest, then
dp, then pp), so TP groups are consecutive ranks and stay within a node.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Tuple

from megarl.errors import ConfigError

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
    mode: str
    world_size: int
    executors: Dict[str, Tuple[int, ...]]
    trainer_tp: int
    trainer_pp: int
    trainer_dp: int
    generator_tp: int
    generator_replicas: int
    channels: List[ChannelSpec] = field(default_factory=list)
    # torch: every generator rank runs an engine shard; sglang: a replica's first rank drives its
    # server over HTTP, the replica's other ranks stand by (the server's workers use their GPUs)
    generator_backend: str = "torch"

    # -- construction ----------------------------------------------------------------------

    @classmethod
    def from_config(cls, cfg) -> "Topology":
        t, g = cfg.trainer, cfg.generator
        trainer = tuple(range(cfg.trainer_dims().world_size))
        if cfg.run.mode == "sync":
            gen_tp, replicas, generator = 1, len(trainer), trainer
        else:
            gen_tp, replicas = g.tp, g.replicas
            generator = tuple(range(len(trainer), len(trainer) + cfg.generator_dims().world_size))
        leaders = generator[::gen_tp]
        topo = cls(
            cfg.run.mode,
            cfg.world_size(),
            {"trainer": trainer, "generator": generator, "reward": leaders},
            t.tp,
            t.pp,
            t.dp,
            gen_tp,
            replicas,
            generator_backend=g.backend,
        )
        topo.channels = [
            # finished, scored groups of every replica to the trainer's first rank ...
            ChannelSpec("rollouts", GATHER, "reward", "trainer", leaders, (trainer[0],)),
            # ... which gives every trainer rank the whole batch (each takes its DP shard)
            ChannelSpec("batch", BROADCAST, "trainer", "trainer", (trainer[0],), trainer),
            # the updated policy, shard to shard (weight_sync) or copied in place (sync mode)
            ChannelSpec("weights", WEIGHTS, "trainer", "generator", trainer, generator),
        ]
        return topo

    # -- membership --------------------------------------------------------------------------

    def roles(self, rank: int) -> List[str]:
        return [name for name, ranks in self.executors.items() if rank in ranks]

    def trainer_rank(self, tp_rank: int, dp_rank: int, pp_rank: int) -> int:
        return self.executors["trainer"][0] + tp_rank + self.trainer_tp * (dp_rank + self.trainer_dp * pp_rank)

    def trainer_groups(self) -> Dict[str, List[List[int]]]:
        tp, pp, dp = self.trainer_tp, self.trainer_pp, self.trainer_dp
        r = self.trainer_rank
        return {
            "tp": [[r(t, d, p) for t in range(tp)] for p in range(pp) for d in range(dp)],
            "dp": [[r(t, d, p) for d in range(dp)] for p in range(pp) for t in range(tp)],
            "pp": [[r(t, d, p) for p in range(pp)] for d in range(dp) for t in range(tp)],
        }

    def generator_tp_groups(self) -> List[List[int]]:
        gen = self.executors["generator"]
        return [list(gen[i * self.generator_tp : (i + 1) * self.generator_tp]) for i in range(self.generator_replicas)]

    def replica_of(self, rank: int) -> Tuple[int, int]:
        """(replica, tp_rank) of a generator rank."""
        return divmod(self.executors["generator"].index(rank), self.generator_tp)

    def runs_generator(self, rank: int) -> bool:
        """Whether this rank runs a generator executor (all torch-engine ranks; SGLang drivers)."""
        if rank not in self.executors["generator"]:
            return False
        return self.generator_backend == "torch" or self.replica_of(rank)[1] == 0

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
        primary = ("trainer", "generator") if self.mode == "async" else ("trainer",)
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
            "mode": self.mode,
            "world_size": self.world_size,
            "executors": {k: _ranges(v) for k, v in self.executors.items()},
            "trainer": f"TP{self.trainer_tp} x PP{self.trainer_pp} x DP{self.trainer_dp}",
            "generator": f"{self.generator_replicas} x TP{self.generator_tp} ({self.generator_backend})",
            "groups": {
                "trainer_tp": len(groups["tp"]),
                "trainer_dp": len(groups["dp"]),
                "trainer_pp": len(groups["pp"]),
                "generator_tp": len(self.generator_tp_groups()),
            },
            "channels": [
                f"{c.name}: {c.kind} {c.sender}{_ranges(c.src)} -> {c.receiver}{_ranges(c.dst)}" for c in self.channels
            ],
        }


def _ranges(ranks) -> str:
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
