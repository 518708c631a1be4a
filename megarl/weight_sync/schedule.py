"""The ordered messages of one weight sync between each (sender, receiver) pair.

Both ends derive the same message list from the same plan, so no metadata
travels with the weights. A message is one point-to-point transfer:

- ``copy``: one rectangle of one tensor, in the generator's dtype;
- ``fp8``: a 128-aligned box of a destination fp8 weight that this sender
  alone fills; the sender assembles it, quantises it (e4m3 + 128x128 block
  scales) and sends the fp8 bytes and the scales -- half the bytes of bf16.

An fp8 weight that no single sender covers block-aligned (a 128x128 block
fed by two senders, as in toy models with heads of 64 rows) is sent as bf16
``copy`` messages and quantised by the receiver once complete ("receiver
quantised"). Real Llama shapes (head_dim 128) never need it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, List, Optional, Set, Tuple

from megarl.weight_sync.fp8 import BLOCK, is_fp8_param, matrix_shape
from megarl.weight_sync.layouts import Range
from megarl.weight_sync.planner import SyncPlan, Transfer


@dataclass(frozen=True)
class Message:
    kind: str  # "copy" | "fp8"
    dst_param: str
    transfer: Optional[Transfer] = None  # copy
    box_rows: Optional[Range] = None  # fp8: destination box
    box_cols: Optional[Range] = None
    parts: Tuple[Transfer, ...] = ()  # fp8: the rectangles filling the box

    def wire_elements(self) -> int:
        if self.kind == "copy":
            return self.transfer.numel
        return (self.box_rows[1] - self.box_rows[0]) * (self.box_cols[1] - self.box_cols[0])


def _aligned(r: Range, size: int) -> bool:
    return r[0] % BLOCK == 0 and (r[1] % BLOCK == 0 or r[1] == size)


def _box(transfers: List[Transfer]) -> Tuple[Range, Range]:
    rows = (min(t.dst_rows[0] for t in transfers), max(t.dst_rows[1] for t in transfers))
    cols = (min(t.dst_cols[0] for t in transfers), max(t.dst_cols[1] for t in transfers))
    return rows, cols


def _blocks(t: Transfer) -> Tuple[Range, Range]:
    return (
        (t.dst_rows[0] // BLOCK, (t.dst_rows[1] - 1) // BLOCK + 1),
        (t.dst_cols[0] // BLOCK, (t.dst_cols[1] - 1) // BLOCK + 1),
    )


def _touch(a: Tuple[Range, Range], b: Tuple[Range, Range]) -> bool:
    return a[0][0] < b[0][1] and b[0][0] < a[0][1] and a[1][0] < b[1][1] and b[1][0] < a[1][1]


def _group_by_blocks(transfers: List[Transfer]) -> List[List[Transfer]]:
    """Group rectangles that share a 128x128 destination block (connected components)."""
    groups: List[List[Transfer]] = []
    for t in transfers:
        joined = [g for g in groups if any(_touch(_blocks(t), _blocks(u)) for u in g)]
        merged = [t] + [u for g in joined for u in g]
        groups = [g for g in groups if g not in joined] + [merged]
    return groups


Box = Tuple[Range, Range]


def sender_quantised_boxes(plan: SyncPlan) -> Dict[Tuple[int, str], Dict[int, List[Box]]]:
    """For each (destination rank, fp8 weight) that senders can quantise: sender -> its boxes.

    A box is a 128-aligned region of the destination weight that one sender fills
    completely; blocks never straddle two boxes, so each sender quantises its own.
    """
    # the [rows, cols] view transfers index (stacked experts [E, R, C] as [E x R, C])
    shapes = {(dst, t.name): matrix_shape(t.shape) for dst, layout in plan.dst_layouts.items() for t in layout}
    by_param: Dict[Tuple[int, str], Dict[int, List[Transfer]]] = defaultdict(lambda: defaultdict(list))
    for (src, dst), transfers in plan.transfers.items():
        for t in transfers:
            if is_fp8_param(t.dst_param):
                by_param[(dst, t.dst_param)][src].append(t)
    result = {}
    # One sender's boxes depend only on where its rectangles land: replicas repeat them.
    seen: Dict[tuple, Optional[List[Box]]] = {}
    for key, per_sender in by_param.items():
        rows_total, cols_total = shapes[key]
        boxes: Dict[int, List[Box]] = {}
        for src, transfers in per_sender.items():
            landing = (rows_total, cols_total, tuple((t.dst_rows, t.dst_cols) for t in transfers))
            if landing not in seen:
                seen[landing] = _sender_boxes(transfers, rows_total, cols_total)
            if seen[landing] is None:
                break
            boxes[src] = seen[landing]
        else:
            result[key] = boxes
    return result


def _sender_boxes(transfers: List[Transfer], rows_total: int, cols_total: int) -> Optional[List[Box]]:
    """The boxes one sender's rectangles of a weight form, or None if they are not whole aligned boxes."""
    out = []
    for group in _group_by_blocks(transfers):
        rows, cols = _box(group)
        area = (rows[1] - rows[0]) * (cols[1] - cols[0])
        if area != sum(t.numel for t in group) or not (_aligned(rows, rows_total) and _aligned(cols, cols_total)):
            return None
        out.append((rows, cols))
    return out


def _inside(t: Transfer, box: Box) -> bool:
    return (
        box[0][0] <= t.dst_rows[0]
        and t.dst_rows[1] <= box[0][1]
        and box[1][0] <= t.dst_cols[0]
        and t.dst_cols[1] <= box[1][1]
    )


def pair_messages(
    plan: SyncPlan,
    src: int,
    dst: int,
    fp8: bool,
    quantised_boxes: Optional[Dict[Tuple[int, str], Dict[int, List[Box]]]] = None,
) -> List[Message]:
    """The messages from ``src`` to ``dst``, in the order both ends use."""
    transfers = plan.transfers.get((src, dst), [])
    if not fp8:
        return [Message("copy", t.dst_param, transfer=t) for t in transfers]
    boxes = quantised_boxes if quantised_boxes is not None else sender_quantised_boxes(plan)
    messages: List[Message] = []
    index: Dict[Tuple[str, Box], int] = {}
    for t in transfers:
        mine = boxes.get((dst, t.dst_param), {}).get(src)
        if mine is None:
            messages.append(Message("copy", t.dst_param, transfer=t))
            continue
        box = next(b for b in mine if _inside(t, b))
        key = (t.dst_param, box)
        if key not in index:
            index[key] = len(messages)
            messages.append(Message("fp8", t.dst_param, box_rows=box[0], box_cols=box[1], parts=(t,)))
        else:
            m = messages[index[key]]
            messages[index[key]] = Message(
                "fp8", m.dst_param, box_rows=m.box_rows, box_cols=m.box_cols, parts=m.parts + (t,)
            )
    return messages


def receiver_quantised_params(plan: SyncPlan, dst: int, quantised_boxes) -> Set[str]:
    """fp8 weights of rank ``dst`` that arrive as bf16 and are quantised on arrival."""
    return {t.name for t in plan.dst_layouts[dst] if is_fp8_param(t.name) and (dst, t.name) not in quantised_boxes}
