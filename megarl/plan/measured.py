"""Measured per-sample times replacing the H100 model's eta_t / eta_g (LlamaRL s.7).

A JSON file (or dict) with any of three tables::

    {"trainer":   [{"tp": 8, "pp": 1, "micro_batch": 1, "seconds_per_sample": 0.91}, ...],
     "generator": [{"tp": 8, "b": 64, "seconds_per_sample": 0.35}, ...],
     "sync_generator": [...]}

or, in the paper's (m, b) notation, ``{"trainer": {"8,1": 0.91}, "generator": {"8,64": 0.35}}``
where m is split as tp = min(m, gpus_per_node), pp = m / tp. ``b`` is the micro-batch for the
trainer and the sequences in flight per replica for a generator. Measured trainer times are
taken as the whole per-sample cost (no separate gradient all-reduce is added). A role with a
table can only use the layouts measured; a generator running more sequences than measured
uses the largest measured b below (eta falls with b, so this errs slow); fewer than the
smallest, the smallest's replica time per step. ``sync_generator`` prices the synchronous
baseline's generation; without it the baseline uses the ``generator`` table when given.
Memory is always checked with the physical model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

from megarl.errors import ConfigError
from megarl.parallel_dims import ParallelDims
from megarl.plan.costs import H100CostModel
from megarl.plan.inputs import TrainerLayout

ROLES = ("trainer", "generator", "sync_generator")
Key = Tuple[int, int]  # (tp, pp)


def _records(role: str, table, gpus_per_node: int) -> List[dict]:
    if isinstance(table, dict):
        out = []
        for key, seconds in table.items():
            try:
                m, b = (int(x) for x in str(key).split(","))
            except ValueError:
                raise ConfigError(f"measured.{role}: key {key!r} is not 'm,b'") from None
            out.append({"m": m, "b": b, "seconds_per_sample": seconds})
        return out
    if isinstance(table, list):
        return table
    raise ConfigError(f"measured.{role} must be a list of records or a dict of 'm,b' -> seconds")


def _layout(role: str, rec: dict, gpus_per_node: int) -> Tuple[int, int, int, float]:
    try:
        if "tp" in rec:
            tp, pp = int(rec["tp"]), int(rec.get("pp", 1))
        else:
            m = int(rec["m"])
            tp = min(m, gpus_per_node)
            pp = m // tp
            if tp * pp != m:
                raise ConfigError(f"measured.{role}: m={m} is not tp x pp with tp <= {gpus_per_node}")
        b = int(rec.get("b", rec.get("micro_batch", 1)))
        seconds = float(rec["seconds_per_sample"])
    except (KeyError, TypeError, ValueError) as err:
        raise ConfigError(f"measured.{role}: bad record {rec!r} ({err})") from None
    if tp < 1 or pp < 1 or b < 1 or not seconds > 0:
        raise ConfigError(f"measured.{role}: record {rec!r} needs positive tp, pp, b and seconds_per_sample")
    return tp, pp, b, seconds


class MeasuredCostModel:
    """The H100 model with eta_t / eta_g looked up in measured tables; memory unchanged."""

    def __init__(self, base: H100CostModel, tables: dict):
        self.base = base
        unknown = set(tables) - set(ROLES)
        if unknown:
            raise ConfigError(f"measured: unknown table(s) {sorted(unknown)}; expected {list(ROLES)}")
        gpn = base.hw.gpus_per_node
        self.trainer: Optional[Dict[Tuple[int, int, int, str], float]] = None
        self.generator: Dict[str, Optional[Dict[Key, List[Tuple[int, float]]]]] = {}
        if "trainer" in tables:
            self.trainer = {}
            for rec in _records("trainer", tables["trainer"], gpn):
                tp, pp, b, seconds = _layout("trainer", rec, gpn)
                self.trainer[(tp, pp, b, rec.get("recompute", "selective"))] = seconds
        for role in ("generator", "sync_generator"):
            if role in tables:
                points: Dict[Key, List[Tuple[int, float]]] = {}
                for rec in _records(role, tables[role], gpn):
                    tp, pp, b, seconds = _layout(role, rec, gpn)
                    points.setdefault((tp, pp), []).append((b, seconds))
                self.generator[role] = {k: sorted(v) for k, v in points.items()}
        if "sync_generator" not in self.generator and "generator" in self.generator:
            self.generator["sync_generator"] = self.generator["generator"]

    def __getattr__(self, name):  # memory model, shapes, hardware: the physical model's
        return getattr(self.base, name)

    # -- which layouts may be searched ------------------------------------------------------

    def trainer_allowed(self, layout: TrainerLayout) -> bool:
        return self.trainer is None or _trainer_key(layout) in self.trainer

    def generator_allowed(self, layout: ParallelDims, role: str = "generator") -> bool:
        table = self.generator.get(role)
        return table is None or (layout.tp, layout.pp) in table

    # -- eta --------------------------------------------------------------------------------

    def trainer_seconds_per_sample(self, layout: TrainerLayout, batch: int) -> float:
        if self.trainer is None:
            return self.base.trainer_seconds_per_sample(layout, batch)
        return self.trainer[_trainer_key(layout)]

    def trainer_step_overhead(self, layout: TrainerLayout) -> float:
        return self.base.trainer_step_overhead(layout) if self.trainer is None else 0.0

    def generator_seconds_per_sample(
        self,
        layout: ParallelDims,
        precision: str,
        sequences: float,
        mode: str = "continuous",
        role: str = "generator",
    ) -> float:
        table = self.generator.get(role)
        if table is None:
            return self.base.generator_seconds_per_sample(layout, precision, sequences, mode, role)
        points = table[(layout.tp, layout.pp)]
        below = [p for p in points if p[0] <= sequences]
        if below:
            return below[-1][1]
        b, seconds = points[0]
        return seconds * b / max(sequences, 1e-9)  # same replica time per step, fewer sequences sharing it


def _trainer_key(layout: TrainerLayout) -> Tuple[int, int, int, str]:
    return (layout.dims.tp, layout.dims.pp, layout.micro_batch, layout.recompute)


def load_measured(source: Union[str, Path, dict], base: H100CostModel) -> MeasuredCostModel:
    if isinstance(source, dict):
        return MeasuredCostModel(base, source)
    path = Path(source)
    if not path.is_file():
        raise ConfigError(f"measured: no file {str(path)!r}")
    try:
        tables = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"measured: {path} is not JSON ({err})") from None
    if not isinstance(tables, dict):
        raise ConfigError(f"measured: {path} must hold a JSON object with {list(ROLES)}")
    return MeasuredCostModel(base, tables)
