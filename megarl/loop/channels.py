"""Channels: named data movements between executors over the job's control group.

Every rank runs ``channel.transfer(value)`` at the same point of the
controller loop (SPMD); ranks not in the channel return at once.

    GATHER     every src rank's value -> a list on dst[0] (src order)
    BROADCAST  src[0]'s value -> every dst rank
    SCATTER    src[0]'s list -> item i to dst[i]

Values are any picklable objects (lists of Samples, metrics); they travel as
byte tensors point to point over a gloo group that spans all executors
(a length header first), so a channel between two executors involves only
their ranks. A peer that died makes the transfer fail with the rank named,
after the control group's timeout at worst.
"""

from __future__ import annotations

import pickle
from typing import Any, List, Optional

import torch
import torch.distributed as dist

from megarl.errors import MegarlError
from megarl.layout import BROADCAST, GATHER, SCATTER, ChannelSpec


def send_object(obj: Any, dst: int, group) -> None:
    data = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
    dist.send(torch.tensor([data.numel()], dtype=torch.int64), group=group, group_dst=dst)
    dist.send(data, group=group, group_dst=dst)


def recv_object(src: int, group) -> Any:
    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, group=group, group_src=src)
    data = torch.empty(int(size), dtype=torch.uint8)
    dist.recv(data, group=group, group_src=src)
    return pickle.loads(data.numpy().tobytes())


class Channel:
    def __init__(self, spec: ChannelSpec, rank: int, group):
        self.spec, self.rank, self.group = spec, rank, group

    def transfer(self, value: Any = None) -> Optional[Any]:
        s = self.spec
        try:
            if s.kind == GATHER:
                return self._gather(value)
            if s.kind == BROADCAST:
                return self._broadcast(value)
            if s.kind == SCATTER:
                return self._scatter(value)
        except RuntimeError as e:  # gloo: a peer's connection closed or timed out
            raise MegarlError(
                f"channel {s.name} ({s.sender} -> {s.receiver}) failed on rank {self.rank}: a peer rank is gone ({e})"
            ) from None
        raise MegarlError(f"channel {s.name}: kind {s.kind} is not a data channel")

    def _gather(self, value) -> Optional[List[Any]]:
        s, out = self.spec, None
        root = s.dst[0]
        if self.rank in s.src and self.rank != root:
            send_object(value, root, self.group)
        if self.rank == root:
            out = [value if src == root else recv_object(src, self.group) for src in s.src]
        return out

    def _broadcast(self, value) -> Optional[Any]:
        s = self.spec
        root = s.src[0]
        if self.rank == root:
            for dst in s.dst:
                if dst != root:
                    send_object(value, dst, self.group)
            return value if root in s.dst else None
        if self.rank in s.dst:
            return recv_object(root, self.group)
        return None

    def _scatter(self, values) -> Optional[Any]:
        s = self.spec
        root = s.src[0]
        mine = None
        if self.rank == root:
            if len(values) != len(s.dst):
                raise MegarlError(f"channel {s.name}: {len(values)} items for {len(s.dst)} receivers")
            for dst, v in zip(s.dst, values):
                if dst == root:
                    mine = v
                else:
                    send_object(v, dst, self.group)
            return mine
        if self.rank in s.dst:
            return recv_object(root, self.group)
        return None
