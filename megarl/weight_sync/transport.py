"""Move the planned bytes: batched point-to-point rounds over the sync group.

Each (sender, receiver) pair exchanges a header (policy version, message
count), then its messages (schedule.py) in rounds of at most ``bucket_bytes``
per pair; a round's sends and receives for all peers go out together through
``torch.distributed.batch_isend_irecv`` (NCCL on GPUs, gloo on CPU). Double
buffering: while round k is on the wire the sender packs (and quantises)
round k+1 and the receiver unpacks round k-1.

Zero copy where the layout allows: a rectangle that is contiguous in the
sender's parameter (and already in the wire dtype) is sent from the parameter
itself, and one contiguous in the receiver's parameter is received straight
into it; only column-split rectangles go through a staging buffer.

Pairs on one device (``ipc_peers``; NCCL refuses two ranks on one GPU) move
their rounds through a shared staging buffer instead (ipc.py), synchronised by
"ready"/"done" flags over the group, which must then be a gloo group.

With ``verify`` every message carries a checksum computed by the sender; the
receiver recomputes it over what landed and raises naming the parameter and
both ranks on any difference.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Set, Tuple

import torch
import torch.distributed as dist

from megarl.errors import MegarlError
from megarl.weight_sync import fp8 as fp8_format
from megarl.weight_sync import ipc
from megarl.weight_sync.planner import SyncPlan
from megarl.weight_sync.schedule import (
    Message,
    pair_messages,
    receiver_quantised_params,
    sender_quantised_boxes,
)

DEFAULT_BUCKET_BYTES = 64 << 20


class WeightSyncError(MegarlError):
    """A sync delivered something other than what the trainer sent."""


@dataclass
class SyncStats:
    version: int = -1
    bytes_sent: int = 0
    bytes_received: int = 0
    messages: int = 0
    rounds: int = 0
    seconds: float = 0.0


def as_2d(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1, 1) if t.dim() == 1 else t


def checksum(t: torch.Tensor) -> torch.Tensor:
    """Order-sensitive float64 checksum of a tensor's values (fp8 bytes read as fp8 values)."""
    if t.dtype == torch.uint8:
        t = t.view(fp8_format.FP8_DTYPE)
    x = t.detach().reshape(-1).to(torch.float64)
    w = (torch.arange(x.numel(), dtype=torch.float64, device=x.device) % 9973) + 1.0
    return torch.stack([x.sum(), (x * w).sum()])


CHECKSUM_WIDTH = 4  # two sums per payload tensor, up to two tensors (fp8 data + scales)


def message_checksum(payload: List[torch.Tensor]) -> torch.Tensor:
    out = torch.zeros(CHECKSUM_WIDTH, dtype=torch.float64)
    sums = torch.cat([checksum(p).cpu() for p in payload])
    out[: sums.numel()] = sums
    return out


def _rounds(messages: List[Message], bytes_of: Callable[[Message], int], bucket_bytes: int) -> List[List[Message]]:
    rounds, current, size = [], [], 0
    for m in messages:
        n = bytes_of(m)
        if current and size + n > bucket_bytes:
            rounds.append(current)
            current, size = [], 0
        current.append(m)
        size += n
    if current:
        rounds.append(current)
    return rounds


def _message_bytes(m: Message, wire_dtype: torch.dtype) -> int:
    if m.kind == "copy":
        return m.wire_elements() * wire_dtype.itemsize
    h, w = m.box_rows[1] - m.box_rows[0], m.box_cols[1] - m.box_cols[0]
    rb, cb = fp8_format.scale_shape((h, w))
    return h * w + rb * cb * 4


class _Endpoint:
    def __init__(self, plan: SyncPlan, rank: int, group, fp8: bool, wire_dtype: torch.dtype,
                 bucket_bytes: int, verify: bool, ipc_peers: Optional[Set[int]]):
        self.plan, self.rank, self.group = plan, rank, group
        self.fp8, self.wire_dtype, self.bucket_bytes, self.verify = fp8, wire_dtype, bucket_bytes, verify
        self.boxes = sender_quantised_boxes(plan) if fp8 else {}
        # Peers on this same device: their bytes go through shared memory (ipc.py).
        self.ipc_peers = set(ipc_peers or ())
        self.staging: Dict[int, torch.Tensor] = {}

    def _rounds_by_peer(self, peers: Dict[int, List[Message]]) -> Dict[int, List[List[Message]]]:
        return {peer: _rounds(ms, lambda m: _message_bytes(m, self.wire_dtype), self.bucket_bytes)
                for peer, ms in peers.items()}

    def _flag(self, op, peer: int, value: int = 0) -> torch.Tensor:
        flag = torch.tensor([value], dtype=torch.int64)
        if op == "send":
            dist.send(flag, group=self.group, group_dst=peer)
        else:
            dist.recv(flag, group=self.group, group_src=peer)
        return flag

    def _p2p(self, op, tensor: torch.Tensor, peer: int) -> dist.P2POp:
        return dist.P2POp(op, tensor, group=self.group, group_peer=peer)

    def _exchange(self, ops: List[dist.P2POp]) -> None:
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()


class WeightSender(_Endpoint):
    """Trainer side: ``params`` maps this rank's Megatron parameter names to tensors."""

    def __init__(self, plan: SyncPlan, rank: int, group, params: Dict[str, torch.Tensor], fp8: bool = False,
                 wire_dtype: torch.dtype = torch.bfloat16, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 verify: bool = False, ipc_peers: Optional[Set[int]] = None):
        super().__init__(plan, rank, group, fp8, wire_dtype, bucket_bytes, verify, ipc_peers)
        self.params = {name: as_2d(t) for name, t in params.items()}
        self.peers = {dst: pair_messages(plan, rank, dst, fp8, self.boxes) for (src, dst) in plan.transfers if src == rank}
        missing = {t.src_param for ms in plan.sends_of(rank).values() for t in ms} - set(self.params)
        if missing:
            raise WeightSyncError(f"sync rank {rank}: the plan sends parameters this rank does not hold: {sorted(missing)[:5]}")

    def _payload(self, m: Message) -> List[torch.Tensor]:
        if m.kind == "copy":
            t = m.transfer
            rect = self.params[t.src_param][t.src_rows[0] : t.src_rows[1], t.src_cols[0] : t.src_cols[1]]
            if rect.dtype == self.wire_dtype and rect.is_contiguous():
                return [rect]  # zero copy: straight from the parameter
            return [rect.to(self.wire_dtype).contiguous()]
        box = torch.empty(m.box_rows[1] - m.box_rows[0], m.box_cols[1] - m.box_cols[0], dtype=torch.float32,
                          device=next(iter(self.params.values())).device)
        for t in m.parts:
            src = self.params[t.src_param][t.src_rows[0] : t.src_rows[1], t.src_cols[0] : t.src_cols[1]]
            box[t.dst_rows[0] - m.box_rows[0] : t.dst_rows[1] - m.box_rows[0],
                t.dst_cols[0] - m.box_cols[0] : t.dst_cols[1] - m.box_cols[0]] = src.to(self.wire_dtype).float()
        q, scale_inv = fp8_format.quantize(box)
        return [q.view(torch.uint8), scale_inv]

    def _share_staging(self, ipc_peers: List[int], rounds) -> None:
        for peer in ipc_peers:
            if peer in self.staging:
                continue
            size = max(ipc.layout([p for m in r for p in self._payload_shapes(m)])[1] for r in rounds[peer])
            self.staging[peer], handle = ipc.create_staging(size, self._device())
            ipc.send_bytes(handle, peer, self.group)

    def _device(self):
        return next(iter(self.params.values())).device

    def _payload_shapes(self, m: Message) -> List[torch.Tensor]:
        """Empty stand-ins with each payload tensor's shape and dtype (for buffer sizing)."""
        if m.kind == "copy":
            t = m.transfer
            return [torch.empty(t.src_rows[1] - t.src_rows[0], t.src_cols[1] - t.src_cols[0], dtype=self.wire_dtype,
                                device="meta")]
        h, w = m.box_rows[1] - m.box_rows[0], m.box_cols[1] - m.box_cols[0]
        return [torch.empty(h, w, dtype=torch.uint8, device="meta"),
                torch.empty(fp8_format.scale_shape((h, w)), dtype=torch.float32, device="meta")]

    def send(self, version: int) -> SyncStats:
        stats = SyncStats(version=version)
        start = time.perf_counter()
        headers = [torch.tensor([version, len(ms)], dtype=torch.int64) for ms in self.peers.values()]
        self._exchange([self._p2p(dist.isend, h, peer) for h, peer in zip(headers, self.peers)])
        rounds = self._rounds_by_peer(self.peers)
        n_rounds = max((len(r) for r in rounds.values()), default=0)
        sums: Dict[int, List[torch.Tensor]] = {peer: [] for peer in self.peers}
        ipc_peers = sorted(self.ipc_peers & set(self.peers))
        self._share_staging(ipc_peers, rounds)

        def pack(k):
            out = []
            for peer, rs in rounds.items():
                if peer in self.ipc_peers:
                    continue
                for m in rs[k] if k < len(rs) else []:
                    payload = self._payload(m)
                    if self.verify:
                        sums[peer].append(message_checksum(payload))
                    out += [(peer, p) for p in payload]
            return out

        ready = pack(0) if n_rounds else []
        for k in range(n_rounds):
            reqs = dist.batch_isend_irecv([self._p2p(dist.isend, p, peer) for peer, p in ready]) if ready else []
            sent, ready = ready, pack(k + 1) if k + 1 < n_rounds else []  # pack the next round meanwhile
            for req in reqs:
                req.wait()
            stats.bytes_sent += sum(p.numel() * p.element_size() for _, p in sent)
            for peer in ipc_peers:  # in a global (sender, receiver) order: no cycles between pairs
                if k < len(rounds[peer]):
                    payloads = [self._payload(m) for m in rounds[peer][k]]
                    if self.verify:
                        sums[peer] += [message_checksum(p) for p in payloads]
                    flat = [p for ps in payloads for p in ps]
                    spans, _ = ipc.layout(flat)
                    for (offset, _), p in zip(spans, flat):
                        ipc.region(self.staging[peer], offset, p).copy_(p)
                    self._flag("send", peer, k)  # ready
                    self._flag("recv", peer)  # done: the buffer may be reused
                    stats.bytes_sent += sum(p.numel() * p.element_size() for p in flat)
            stats.messages += sum(len(rs[k]) for rs in rounds.values() if k < len(rs))
        if self.verify:
            self._exchange([self._p2p(dist.isend, torch.stack(s), peer) for peer, s in sums.items()])
        stats.rounds = n_rounds
        stats.seconds = time.perf_counter() - start
        return stats


class WeightReceiver(_Endpoint):
    """Generator side: ``params`` maps this rank's SGLang parameter names to tensors
    (with ``<name>_scale_inv`` tensors for fp8 weights in fp8 mode). Small enough
    to run inside an SGLang TP worker as well as in megarl's own engine."""

    def __init__(self, plan: SyncPlan, rank: int, group, params: Dict[str, torch.Tensor], fp8: bool = False,
                 wire_dtype: torch.dtype = torch.bfloat16, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 verify: bool = False, ipc_peers: Optional[Set[int]] = None):
        super().__init__(plan, rank, group, fp8, wire_dtype, bucket_bytes, verify, ipc_peers)
        self.params = {name: as_2d(t) for name, t in params.items()}
        self.peers = {src: pair_messages(plan, src, rank, fp8, self.boxes) for (src, dst) in plan.transfers if dst == rank}
        self.late_quantised = receiver_quantised_params(plan, rank, self.boxes) if fp8 else set()
        expected = {t.name for t in plan.dst_layouts[rank]}
        missing = expected - set(self.params)
        if missing:
            raise WeightSyncError(f"sync rank {rank}: receiver lacks parameters {sorted(missing)[:5]}")

    def _targets(self, m: Message, staging: Dict[str, torch.Tensor]) -> List[Tuple[torch.Tensor, Optional[torch.Tensor]]]:
        """(buffer to receive into, view to copy it to afterwards or None) for each payload tensor."""
        if m.kind == "copy":
            t = m.transfer
            base = staging.get(m.dst_param, self.params[m.dst_param])
            view = base[t.dst_rows[0] : t.dst_rows[1], t.dst_cols[0] : t.dst_cols[1]]
            if view.dtype == self.wire_dtype and view.is_contiguous():
                return [(view, None)]
            return [(torch.empty(view.shape, dtype=self.wire_dtype, device=view.device), view)]
        data = self.params[m.dst_param].view(torch.uint8)[m.box_rows[0] : m.box_rows[1], m.box_cols[0] : m.box_cols[1]]
        r0, c0 = m.box_rows[0] // fp8_format.BLOCK, m.box_cols[0] // fp8_format.BLOCK
        rb, cb = fp8_format.scale_shape((m.box_rows[1] - m.box_rows[0], m.box_cols[1] - m.box_cols[0]))
        scales = self.params[fp8_format.scale_name(m.dst_param)][r0 : r0 + rb, c0 : c0 + cb]
        out = []
        for view in (data, scales):
            out.append((view, None) if view.is_contiguous() else (torch.empty_like(view, memory_format=torch.contiguous_format), view))
        return out

    def receive(self, expected_version: Optional[int] = None) -> SyncStats:
        stats = SyncStats()
        start = time.perf_counter()
        headers = {peer: torch.zeros(2, dtype=torch.int64) for peer in self.peers}
        self._exchange([self._p2p(dist.irecv, h, peer) for peer, h in headers.items()])
        versions = {int(h[0]) for h in headers.values()}
        for peer, h in headers.items():
            if int(h[1]) != len(self.peers[peer]):
                raise WeightSyncError(f"sync rank {self.rank}: sender {peer} announces {int(h[1])} messages, "
                                      f"the plan says {len(self.peers[peer])}: the two sides use different plans")
        if len(versions) > 1 or (expected_version is not None and versions and versions != {expected_version}):
            raise WeightSyncError(f"sync rank {self.rank}: senders disagree on the policy version: {sorted(versions)}")
        stats.version = versions.pop() if versions else -1
        staging = {name: torch.empty(self.params[name].shape, dtype=self.wire_dtype, device=self.params[name].device)
                   for name in self.late_quantised}
        rounds = self._rounds_by_peer(self.peers)
        n_rounds = max((len(r) for r in rounds.values()), default=0)
        landed: Dict[int, List[Tuple[Message, List[torch.Tensor]]]] = {peer: [] for peer in self.peers}
        pending: List[Tuple[torch.Tensor, torch.Tensor]] = []
        ipc_peers = sorted(self.ipc_peers & set(self.peers))
        for peer in ipc_peers:
            if peer not in self.staging:
                self.staging[peer] = ipc.open_staging(ipc.recv_bytes(peer, self.group))
        for k in range(n_rounds):
            ops, copies = [], []
            for peer, rs in rounds.items():
                if peer in self.ipc_peers:
                    continue
                for m in rs[k] if k < len(rs) else []:
                    targets = self._targets(m, staging)
                    ops += [self._p2p(dist.irecv, buf, peer) for buf, _ in targets]
                    copies += [(buf, view) for buf, view in targets if view is not None]
                    landed[peer].append((m, [view if view is not None else buf for buf, view in targets]))
                    stats.messages += 1
            reqs = dist.batch_isend_irecv(ops) if ops else []
            for buf, view in pending:  # unpack the previous round while this one is on the wire
                view.copy_(buf)
            for req in reqs:
                req.wait()
            pending = copies
            stats.bytes_received += sum(op.tensor.numel() * op.tensor.element_size() for op in ops)
            for peer in ipc_peers:
                if k < len(rounds[peer]):
                    self._flag("recv", peer)  # ready
                    targets = [(m, self._targets(m, staging)) for m in rounds[peer][k]]
                    flat = [pair for _, ts in targets for pair in ts]
                    spans, _ = ipc.layout([buf for buf, _ in flat])
                    for (offset, _), (buf, view) in zip(spans, flat):
                        buf.copy_(ipc.region(self.staging[peer], offset, buf))
                        if view is not None:
                            view.copy_(buf)
                    self._flag("send", peer)  # done
                    for m, ts in targets:
                        landed[peer].append((m, [view if view is not None else buf for buf, view in ts]))
                        stats.messages += 1
                    stats.bytes_received += sum(buf.numel() * buf.element_size() for buf, _ in flat)
        for buf, view in pending:
            view.copy_(buf)
        for name, bf16 in staging.items():
            q, scale_inv = fp8_format.quantize(bf16)
            self.params[name].copy_(q)
            self.params[fp8_format.scale_name(name)].copy_(scale_inv)
        if self.verify:
            self._verify(landed)
        stats.rounds = n_rounds
        stats.seconds = time.perf_counter() - start
        return stats

    def _verify(self, landed) -> None:
        sent = {peer: torch.zeros(len(ms), CHECKSUM_WIDTH, dtype=torch.float64) for peer, ms in landed.items()}
        self._exchange([self._p2p(dist.irecv, sent[peer], peer) for peer in landed])
        for peer, ms in landed.items():
            for (m, views), want in zip(ms, sent[peer]):
                got = message_checksum(views)
                if not torch.allclose(got, want, rtol=1e-9, atol=0.0):
                    raise WeightSyncError(
                        f"verify: {m.dst_param} on generator sync rank {self.rank} does not match what trainer "
                        f"sync rank {peer} sent (checksum {got.tolist()} vs {want.tolist()})"
                    )
