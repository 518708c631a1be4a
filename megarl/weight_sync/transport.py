"""Move the planned bytes: batched point-to-point rounds over the sync group.

Each (sender, receiver) pair exchanges a header (policy version, message
count), then its messages (schedule.py) in rounds of at most ``bucket_bytes``
per pair; a round's sends and receives for all peers go out together through
``torch.distributed.batch_isend_irecv`` (NCCL on GPUs, gloo on CPU). Double
buffering: while round k is on the wire the sender packs (and quantises)
round k+1 and the receiver unpacks round k-1.

Coalescing: within one round of one pair, every payload tensor smaller than
``pack_below_bytes`` (norms, fp8 scales, the thin rectangles of toy models)
travels in one flat byte buffer: the sender copies them in, the receiver
copies them out. Both ends derive the packing (which payloads, at which byte
offsets) from the plan, so nothing but the payload bytes goes on the wire,
and the pack is dense (payloads ordered by element size, so every offset is
aligned for its dtype with no padding): bytes moved stay exactly the minimum.

Zero copy for the rest: a large rectangle that is contiguous in the sender's
parameter (and already in the wire dtype) is sent from the parameter itself,
and one contiguous in the receiver's parameter is received straight into it;
only column-split rectangles go through a staging buffer.

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
from megarl.weight_sync.settings import DEFAULT_BUCKET_BYTES, PACK_BELOW_BYTES, WireFormat


class WeightSyncError(MegarlError):
    """A sync delivered something other than what the trainer sent."""


@dataclass
class SyncStats:
    version: int = -1
    bytes_sent: int = 0
    bytes_received: int = 0
    messages: int = 0  # planned messages (schedule.py), however they travel
    rounds: int = 0
    seconds: float = 0.0
    wire_messages: int = 0  # point-to-point data transfers: packs + direct payloads (not headers, checksums)


def as_2d(t: torch.Tensor) -> torch.Tensor:
    """The view layouts' blocks index: [n, 1] for vectors, [-1, last dim] for stacked experts."""
    return t.view(-1, 1) if t.dim() == 1 else t.view(-1, t.shape[-1]) if t.dim() > 2 else t


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


def payload_specs(m: Message, wire_dtype: torch.dtype) -> List[Tuple[Tuple[int, int], torch.dtype]]:
    """(shape, dtype) of each tensor a message carries: a copy's rectangle in the wire
    dtype, or an fp8 box's e4m3 bytes (as uint8) and its fp32 block scales."""
    if m.kind == "copy":
        t = m.transfer
        return [((t.src_rows[1] - t.src_rows[0], t.src_cols[1] - t.src_cols[0]), wire_dtype)]
    h, w = m.box_rows[1] - m.box_rows[0], m.box_cols[1] - m.box_cols[0]
    return [((h, w), torch.uint8), (fp8_format.scale_shape((h, w)), torch.float32)]


def _nbytes(spec: Tuple[Tuple[int, int], torch.dtype]) -> int:
    (h, w), dtype = spec
    return h * w * dtype.itemsize


def _message_bytes(m: Message, wire_dtype: torch.dtype) -> int:
    return sum(_nbytes(s) for s in payload_specs(m, wire_dtype))


@dataclass(frozen=True)
class WireRound:
    """One round of one pair as it goes on the wire: first the pack (if any), then the
    direct payloads, in this order on both ends."""

    messages: Tuple[Message, ...]
    packed: Tuple[Tuple[int, int, int], ...]  # (message index, payload index, byte offset in the pack)
    pack_bytes: int
    direct: Tuple[Tuple[int, int], ...]  # (message index, payload index)

    @property
    def wire_messages(self) -> int:
        return (1 if self.packed else 0) + len(self.direct)


def wire_rounds(
    messages: List[Message],
    wire_dtype: torch.dtype,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    pack_below_bytes: int = PACK_BELOW_BYTES,
) -> List[WireRound]:
    """The rounds of one pair's messages and, in each, which payloads share the pack.

    A function of the plan alone (shapes and dtypes), so sender and receiver agree.
    A lone small payload is sent directly (a pack of one would only add copies).
    """
    out = []
    for msgs in _rounds(messages, lambda m: _message_bytes(m, wire_dtype), bucket_bytes):
        items = [(i, j, spec) for i, m in enumerate(msgs) for j, spec in enumerate(payload_specs(m, wire_dtype))]
        small = [it for it in items if _nbytes(it[2]) < pack_below_bytes]
        if len(small) < 2:
            small = []
        # Widest elements first: every offset stays a multiple of its own element size.
        small.sort(key=lambda it: -it[2][1].itemsize)
        packed, offset = [], 0
        for i, j, spec in small:
            packed.append((i, j, offset))
            offset += _nbytes(spec)
        in_pack = {(i, j) for i, j, _ in packed}
        direct = tuple((i, j) for i, j, _ in items if (i, j) not in in_pack)
        out.append(WireRound(tuple(msgs), tuple(packed), offset, direct))
    return out


def _region(pack: torch.Tensor, offset: int, spec: Tuple[Tuple[int, int], torch.dtype]) -> torch.Tensor:
    shape, dtype = spec
    return pack[offset : offset + _nbytes(spec)].view(dtype).view(shape)


class _Endpoint:
    """One rank's end of a planned sync; WeightSender and WeightReceiver share this constructor.

    ``params``: this rank's tensors by name (Megatron's on a sender, SGLang's on a receiver);
    ``wire``: what goes on the wire, equal on both ends; ``ipc_peers``: the sync ranks on this
    same device, whose bytes go through shared memory (ipc.py)."""

    def __init__(
        self,
        plan: SyncPlan,
        rank: int,
        group,
        params: Dict[str, torch.Tensor],
        wire: WireFormat = WireFormat(),
        ipc_peers: Optional[Set[int]] = None,
    ):
        self.plan, self.rank, self.group, self.wire = plan, rank, group, wire
        self.fp8, self.wire_dtype, self.verify = wire.fp8, wire.dtype, wire.verify
        self.boxes = sender_quantised_boxes(plan) if wire.fp8 else {}
        self.params = {name: as_2d(t) for name, t in params.items()}
        # Peers on this same device: their bytes go through shared memory (ipc.py).
        self.ipc_peers = set(ipc_peers or ())
        self.staging: Dict[int, torch.Tensor] = {}
        self.packs: Dict[int, List[torch.Tensor]] = {}  # peer -> two pack buffers (double buffering)
        self.peers: Dict[int, List[Message]] = self._pair_messages()
        self.rounds = {
            peer: wire_rounds(ms, wire.dtype, wire.bucket_bytes, wire.pack_below_bytes)
            for peer, ms in self.peers.items()
        }
        self._prepare()

    def _pair_messages(self) -> Dict[int, List[Message]]:
        """Each peer's planned messages with this rank, in order."""
        raise NotImplementedError

    def _prepare(self) -> None:
        """This side's own state from the plan; raise, naming the rank, when ``params`` lack what it moves."""
        raise NotImplementedError

    def _pack(self, peer: int, k: int, device) -> torch.Tensor:
        """Round k's pack buffer for ``peer`` (two per peer, alternating, reused across syncs)."""
        if peer not in self.packs:
            size = max((r.pack_bytes for r in self.rounds[peer]), default=0)
            self.packs[peer] = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(2)]
        return self.packs[peer][k % 2][: self.rounds[peer][k].pack_bytes]

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

    def _pair_messages(self) -> Dict[int, List[Message]]:
        plan, rank = self.plan, self.rank
        return {
            dst: pair_messages(plan, rank, dst, self.fp8, self.boxes) for (src, dst) in plan.transfers if src == rank
        }

    def _prepare(self) -> None:
        missing = {t.src_param for ms in self.plan.sends_of(self.rank).values() for t in ms} - set(self.params)
        if missing:
            raise WeightSyncError(
                f"sync rank {self.rank}: the plan sends parameters this rank does not hold: {sorted(missing)[:5]}"
            )

    def _payload(self, m: Message) -> List[torch.Tensor]:
        """The message's tensors as they are at hand: a view of the parameter for a copy
        (any dtype, maybe strided), the quantised bytes and scales for an fp8 box."""
        if m.kind == "copy":
            t = m.transfer
            return [self.params[t.src_param][t.src_rows[0] : t.src_rows[1], t.src_cols[0] : t.src_cols[1]]]
        box = torch.empty(
            m.box_rows[1] - m.box_rows[0], m.box_cols[1] - m.box_cols[0], dtype=torch.float32, device=self._device()
        )
        for t in m.parts:
            src = self.params[t.src_param][t.src_rows[0] : t.src_rows[1], t.src_cols[0] : t.src_cols[1]]
            box[
                t.dst_rows[0] - m.box_rows[0] : t.dst_rows[1] - m.box_rows[0],
                t.dst_cols[0] - m.box_cols[0] : t.dst_cols[1] - m.box_cols[0],
            ] = src.to(self.wire_dtype).float()
        q, scale_inv = fp8_format.quantize(box)
        return [q.view(torch.uint8), scale_inv]

    def _wire_payload(self, m: Message) -> List[torch.Tensor]:
        """The message's tensors in wire form: contiguous, in the wire dtype (zero copy when already so)."""
        out = []
        for p, (_, dtype) in zip(self._payload(m), payload_specs(m, self.wire_dtype)):
            out.append(p if p.dtype == dtype and p.is_contiguous() else p.to(dtype).contiguous())
        return out

    def _share_staging(self, ipc_peers: List[int]) -> None:
        for peer in ipc_peers:
            if peer in self.staging:
                continue
            size = max(
                ipc.layout([p for m in r.messages for p in self._payload_shapes(m)])[1] for r in self.rounds[peer]
            )
            self.staging[peer], handle = ipc.create_staging(size, self._device())
            ipc.send_bytes(handle, peer, self.group)

    def _device(self):
        return next(iter(self.params.values())).device

    def _payload_shapes(self, m: Message) -> List[torch.Tensor]:
        """Empty stand-ins with each payload tensor's shape and dtype (for buffer sizing)."""
        return [torch.empty(shape, dtype=dtype, device="meta") for shape, dtype in payload_specs(m, self.wire_dtype)]

    def _round_ops(self, peer: int, k: int, sums: Dict[int, List[torch.Tensor]]) -> List[Tuple[int, torch.Tensor]]:
        """Round k for ``peer``: fill its pack, and list (peer, tensor) in wire order."""
        r = self.rounds[peer][k]
        payloads = [self._payload(m) for m in r.messages]
        wire: List[List[Optional[torch.Tensor]]] = [[None] * len(p) for p in payloads]
        out = []
        if r.packed:
            pack = self._pack(peer, k, self._device())
            for i, j, offset in r.packed:
                region = _region(pack, offset, payload_specs(r.messages[i], self.wire_dtype)[j])
                region.copy_(payloads[i][j])
                wire[i][j] = region
            out.append((peer, pack))
        for i, j in r.direct:
            _, dtype = payload_specs(r.messages[i], self.wire_dtype)[j]
            p = payloads[i][j]
            wire[i][j] = p if p.dtype == dtype and p.is_contiguous() else p.to(dtype).contiguous()
            out.append((peer, wire[i][j]))
        if self.verify:
            sums[peer] += [message_checksum(w) for w in wire]
        return out

    def send(self, version: int) -> SyncStats:
        stats = SyncStats(version=version)
        start = time.perf_counter()
        headers = [torch.tensor([version, len(ms)], dtype=torch.int64) for ms in self.peers.values()]
        self._exchange([self._p2p(dist.isend, h, peer) for h, peer in zip(headers, self.peers)])
        rounds = self.rounds
        n_rounds = max((len(r) for r in rounds.values()), default=0)
        sums: Dict[int, List[torch.Tensor]] = {peer: [] for peer in self.peers}
        ipc_peers = sorted(self.ipc_peers & set(self.peers))
        self._share_staging(ipc_peers)

        def pack(k):
            return [
                op
                for peer, rs in rounds.items()
                if peer not in self.ipc_peers and k < len(rs)
                for op in self._round_ops(peer, k, sums)
            ]

        ready = pack(0) if n_rounds else []
        for k in range(n_rounds):
            reqs = dist.batch_isend_irecv([self._p2p(dist.isend, p, peer) for peer, p in ready]) if ready else []
            sent, ready = ready, pack(k + 1) if k + 1 < n_rounds else []  # pack the next round meanwhile
            for req in reqs:
                req.wait()
            stats.bytes_sent += sum(p.numel() * p.element_size() for _, p in sent)
            stats.wire_messages += len(sent)
            for peer in ipc_peers:  # in a global (sender, receiver) order: no cycles between pairs
                if k < len(rounds[peer]):
                    payloads = [self._wire_payload(m) for m in rounds[peer][k].messages]
                    if self.verify:
                        sums[peer] += [message_checksum(p) for p in payloads]
                    flat = [p for ps in payloads for p in ps]
                    spans, _ = ipc.layout(flat)
                    for (offset, _), p in zip(spans, flat):
                        ipc.region(self.staging[peer], offset, p).copy_(p)
                    self._flag("send", peer, k)  # ready
                    self._flag("recv", peer)  # done: the buffer may be reused
                    stats.bytes_sent += sum(p.numel() * p.element_size() for p in flat)
            stats.messages += sum(len(rs[k].messages) for rs in rounds.values() if k < len(rs))
        if self.verify:
            self._exchange([self._p2p(dist.isend, torch.stack(s), peer) for peer, s in sums.items()])
        stats.rounds = n_rounds
        stats.seconds = time.perf_counter() - start
        return stats


class WeightReceiver(_Endpoint):
    """Generator side: ``params`` maps this rank's SGLang parameter names to tensors
    (with ``<name>_scale_inv`` tensors for fp8 weights in fp8 mode). Small enough
    to run inside an SGLang TP worker as well as in megarl's own engine."""

    def _pair_messages(self) -> Dict[int, List[Message]]:
        plan, rank = self.plan, self.rank
        return {
            src: pair_messages(plan, src, rank, self.fp8, self.boxes) for (src, dst) in plan.transfers if dst == rank
        }

    def _prepare(self) -> None:
        self.late_quantised = receiver_quantised_params(self.plan, self.rank, self.boxes) if self.fp8 else set()
        missing = {t.name for t in self.plan.dst_layouts[self.rank]} - set(self.params)
        if missing:
            raise WeightSyncError(f"sync rank {self.rank}: receiver lacks parameters {sorted(missing)[:5]}")

    def _dests(self, m: Message, staging: Dict[str, torch.Tensor]) -> List[torch.Tensor]:
        """Where each payload tensor of ``m`` ends up (views of the parameters, maybe strided)."""
        if m.kind == "copy":
            t = m.transfer
            base = staging.get(m.dst_param, self.params[m.dst_param])
            return [base[t.dst_rows[0] : t.dst_rows[1], t.dst_cols[0] : t.dst_cols[1]]]
        data = self.params[m.dst_param].view(torch.uint8)[m.box_rows[0] : m.box_rows[1], m.box_cols[0] : m.box_cols[1]]
        r0, c0 = m.box_rows[0] // fp8_format.BLOCK, m.box_cols[0] // fp8_format.BLOCK
        rb, cb = fp8_format.scale_shape((m.box_rows[1] - m.box_rows[0], m.box_cols[1] - m.box_cols[0]))
        scales = self.params[fp8_format.scale_name(m.dst_param)][r0 : r0 + rb, c0 : c0 + cb]
        return [data, scales]

    def _targets(
        self, m: Message, staging: Dict[str, torch.Tensor]
    ) -> List[Tuple[torch.Tensor, Optional[torch.Tensor]]]:
        """(buffer to receive into, view to copy it to afterwards or None) for each payload tensor."""
        out = []
        for view, (_, dtype) in zip(self._dests(m, staging), payload_specs(m, self.wire_dtype)):
            if view.dtype == dtype and view.is_contiguous():
                out.append((view, None))  # zero copy: straight into the parameter
            else:
                out.append((torch.empty(view.shape, dtype=dtype, device=view.device), view))
        return out

    def receive(self, expected_version: Optional[int] = None) -> SyncStats:
        stats = SyncStats()
        start = time.perf_counter()
        headers = {peer: torch.zeros(2, dtype=torch.int64) for peer in self.peers}
        self._exchange([self._p2p(dist.irecv, h, peer) for peer, h in headers.items()])
        versions = {int(h[0]) for h in headers.values()}
        for peer, h in headers.items():
            if int(h[1]) != len(self.peers[peer]):
                raise WeightSyncError(
                    f"sync rank {self.rank}: sender {peer} announces {int(h[1])} messages, "
                    f"the plan says {len(self.peers[peer])}: the two sides use different plans"
                )
        if len(versions) > 1 or (expected_version is not None and versions and versions != {expected_version}):
            raise WeightSyncError(f"sync rank {self.rank}: senders disagree on the policy version: {sorted(versions)}")
        stats.version = versions.pop() if versions else -1
        staging = {
            name: torch.empty(self.params[name].shape, dtype=self.wire_dtype, device=self.params[name].device)
            for name in self.late_quantised
        }
        rounds = self.rounds
        n_rounds = max((len(r) for r in rounds.values()), default=0)
        landed: Dict[int, List[Tuple[Message, List[torch.Tensor]]]] = {peer: [] for peer in self.peers}
        pending: List[Tuple[torch.Tensor, torch.Tensor]] = []
        ipc_peers = sorted(self.ipc_peers & set(self.peers))
        for peer in ipc_peers:
            if peer not in self.staging:
                self.staging[peer] = ipc.open_staging(ipc.recv_bytes(peer, self.group))
        for k in range(n_rounds):
            ops, copies = [], []  # copies: (landed buffer, destination view), done once the round is in
            for peer, rs in rounds.items():
                if peer in self.ipc_peers or k >= len(rs):
                    continue
                r = rs[k]
                dests = [self._dests(m, staging) for m in r.messages]
                if r.packed:
                    pack = self._pack(peer, k, next(iter(self.params.values())).device)
                    ops.append(self._p2p(dist.irecv, pack, peer))
                    for i, j, offset in r.packed:
                        copies.append(
                            (_region(pack, offset, payload_specs(r.messages[i], self.wire_dtype)[j]), dests[i][j])
                        )
                for i, j in r.direct:
                    _, dtype = payload_specs(r.messages[i], self.wire_dtype)[j]
                    view = dests[i][j]
                    if view.dtype == dtype and view.is_contiguous():
                        ops.append(self._p2p(dist.irecv, view, peer))  # zero copy
                    else:
                        buf = torch.empty(view.shape, dtype=dtype, device=view.device)
                        ops.append(self._p2p(dist.irecv, buf, peer))
                        copies.append((buf, view))
                landed[peer] += list(zip(r.messages, dests))
                stats.messages += len(r.messages)
            reqs = dist.batch_isend_irecv(ops) if ops else []
            for buf, view in pending:  # unpack the previous round while this one is on the wire
                view.copy_(buf)
            for req in reqs:
                req.wait()
            pending = copies
            stats.bytes_received += sum(op.tensor.numel() * op.tensor.element_size() for op in ops)
            stats.wire_messages += len(ops)
            for peer in ipc_peers:
                if k < len(rounds[peer]):
                    self._flag("recv", peer)  # ready
                    targets = [(m, self._targets(m, staging)) for m in rounds[peer][k].messages]
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
