"""One rank's end of the weights channel: ``WeightSynchronizer.sync(version) -> SyncStats``.

The controller calls ``sync`` on every rank at the same point of the loop and
never asks how the weights travel; the wiring (loop/wiring.py) picks the
implementation from the rank's role, the run mode and the generator backend,
and builds it with factory.py (NeMo-RL's weight_sync interfaces/factory split):

    ShardToShardSender     a trainer rank (async): sends its Megatron shards straight to the
                           generator ranks or SGLang TP workers that need them
    EngineShardReceiver    a torch-engine generator rank (async): receives its own shard
                           between two decode steps
    SglangShardReceiver    an SGLang replica's driver rank (async): runs SGLang's in-flight
                           update protocol; the transfer itself runs in the server's TP
                           workers (generator/sglang/worker_receiver.py)
    ColocatedCopy          every rank in sync mode: Megatron shards -> the rank's own engine
                           on the same device (colocated.py)
    NoWeights              a rank with no part in it (an SGLang replica's other ranks)

On a receiving side the version that landed comes back in the stats (from
the senders' header, or from the server's answer) and the backend takes it
from there: nothing outside sets an engine's version.
"""

from __future__ import annotations

import abc
import time
from typing import Callable, Tuple

from megarl.weight_sync.colocated import copy_colocated
from megarl.weight_sync.endpoints import TrainerSync
from megarl.weight_sync.settings import SyncSettings
from megarl.weight_sync.transport import SyncStats


class WeightSynchronizer(abc.ABC):
    @abc.abstractmethod
    def sync(self, version: int) -> SyncStats:
        """Move policy ``version`` (the trainer's) to where it is needed; return what moved."""

    def close(self) -> None:
        pass


class NoWeights(WeightSynchronizer):
    def sync(self, version: int) -> SyncStats:
        return SyncStats(version=version)


class ShardToShardSender(WeightSynchronizer):
    """A trainer rank's shards -> the generators (TrainerSync over a sync group).

    ``connect()`` returns (sync group, same-device peers); it runs at the first sync, so a
    group whose other members are SGLang workers forms when the servers first receive."""

    def __init__(
        self,
        settings: SyncSettings,
        chunks,
        sync_rank: int,
        connect: Callable[[], Tuple[object, set]],
        eager: bool = False,
    ):
        self.settings, self.chunks, self.sync_rank, self.connect = settings, chunks, sync_rank, connect
        self.sender = None
        if eager:
            self._connect()

    def _connect(self) -> None:
        group, peers = self.connect()
        self.sender = TrainerSync(self.settings, self.chunks, group, self.sync_rank, ipc_peers=peers)

    def sync(self, version: int) -> SyncStats:
        if self.sender is None:
            self._connect()
        return self.sender.push(version)


class EngineShardReceiver(WeightSynchronizer):
    """A torch-engine generator rank: its shard lands in the engine's tensors between two steps."""

    def __init__(self, backend, receiver):
        self.backend, self.receiver = backend, receiver  # receiver: endpoints.GeneratorSync

    def sync(self, version: int) -> SyncStats:
        return self.backend.update_weights(lambda: self.receiver.pull(expected_version=version))


class SglangShardReceiver(WeightSynchronizer):
    """An SGLang replica's driver: pause in place, begin, trigger megarl's receiver in every TP
    worker (which pulls its shard from the trainer ranks), end, set the version, continue."""

    def __init__(self, backend, tp: int, loader: str):
        self.backend, self.tp, self.loader = backend, tp, loader

    def sync(self, version: int) -> SyncStats:
        def transfer() -> SyncStats:
            start = time.perf_counter()
            self.backend.post_weights_trigger(version, self.tp, self.loader)  # answered once every worker landed
            return SyncStats(version=version, seconds=time.perf_counter() - start)

        return self.backend.update_weights(transfer)


class ColocatedCopy(WeightSynchronizer):
    """Sync mode: this rank's Megatron shards -> its own engine, on the device that holds both."""

    def __init__(self, spec, chunks, backend, norm_names: str = "local"):
        self.spec, self.chunks, self.backend, self.norm_names = spec, chunks, backend, norm_names
        self.last = None  # the last copy's ColocatedCopyStats (peak temporary bytes, seconds)

    def sync(self, version: int) -> SyncStats:
        def copy() -> SyncStats:
            self.last = copy_colocated(self.spec, self.chunks, self.backend.params, norm_names=self.norm_names)
            return SyncStats(version=version, bytes_received=self.last.bytes_copied, seconds=self.last.seconds)

        return self.backend.update_weights(copy)
