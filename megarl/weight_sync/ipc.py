"""Same-device weight transfers through shared memory instead of the network.

NCCL refuses a communicator with two ranks on one GPU, which is exactly the
situation of colocated runs and single-GPU machines (trainer rank and
generator worker on one device). For such pairs the sender writes each round's
payload into a staging buffer the receiver has mapped, and two one-element
flags over the sync group order the accesses ("ready": sender -> receiver,
"done": receiver -> sender).

The buffer is shared with a CUDA IPC handle on GPUs (torch.multiprocessing's
``reduce_tensor``, the mechanism torch uses to pass CUDA tensors between
processes), or with a /dev/shm file on CPU. Pairs are found automatically by
comparing (host, CUDA device) at set-up; on CPU nothing is colocated unless a
caller asks (the tests do, to exercise this path without a GPU).
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import uuid
from typing import Iterable, Optional, Set, Tuple

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import reduce_tensor

ALIGN = 64  # byte alignment of each payload inside the staging buffer


def device_identity(device: Optional[torch.device]) -> Tuple[str, Optional[str]]:
    if device is not None and device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return socket.gethostname(), str(getattr(props, "uuid", device.index))
    return socket.gethostname(), None


def colocated_peers(group, rank: int, device: Optional[torch.device]) -> Set[int]:
    """Ranks of the sync group on this very GPU (never on CPU: there gloo works between any ranks)."""
    mine = device_identity(device)
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    return {r for r, info in enumerate(everyone) if r != rank and mine[1] is not None and tuple(info) == mine}


def create_staging(nbytes: int, device: Optional[torch.device]) -> Tuple[torch.Tensor, bytes]:
    """A byte buffer another process on this device can map, and the handle to map it with."""
    nbytes = max(nbytes, 1)
    if device is not None and device.type == "cuda":
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return buffer, pickle.dumps(reduce_tensor(buffer))
    path = os.path.join(
        "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir(), f"megarl_sync_{uuid.uuid4().hex}"
    )
    buffer = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
    return buffer, pickle.dumps(("file", path, nbytes))


def open_staging(handle: bytes) -> torch.Tensor:
    obj = pickle.loads(handle)
    if isinstance(obj, tuple) and obj and obj[0] == "file":
        _, path, nbytes = obj
        buffer = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        os.unlink(path)  # both ends have it mapped; the memory lives until both let go
        return buffer
    rebuild, args = obj
    return rebuild(*args)


def send_bytes(data: bytes, peer: int, group) -> None:
    payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    dist.send(torch.tensor([payload.numel()], dtype=torch.int64), group=group, group_dst=peer)
    dist.send(payload, group=group, group_dst=peer)


def recv_bytes(peer: int, group) -> bytes:
    n = torch.zeros(1, dtype=torch.int64)
    dist.recv(n, group=group, group_src=peer)
    payload = torch.empty(int(n), dtype=torch.uint8)
    dist.recv(payload, group=group, group_src=peer)
    return payload.numpy().tobytes()


def layout(tensors: Iterable[torch.Tensor]):
    """(offset, nbytes) of each tensor packed into a staging buffer, and the total size."""
    spans, offset = [], 0
    for t in tensors:
        n = t.numel() * t.element_size()
        spans.append((offset, n))
        offset += -(-n // ALIGN) * ALIGN
    return spans, offset


def region(staging: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    n = like.numel() * like.element_size()
    return staging[offset : offset + n].view(like.dtype).view(like.shape)
