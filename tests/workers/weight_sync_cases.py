"""The ordered list of sync cases both sides of the weight-sync test walk through."""

from dataclasses import dataclass

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Case:
    model: str
    layout: str
    dst_tp: int
    dtype: torch.dtype
    fp8: bool

    @property
    def name(self) -> str:
        dtype = "fp8" if self.fp8 else str(self.dtype).removeprefix("torch.")
        return f"{self.model.rstrip('/').split('/')[-2]}:{self.layout}->tp{self.dst_tp}:{dtype}"


def cases(args, trainer_world: int):
    out = []
    for model in args.models:
        for layout in args.layouts:
            tp, pp = (int(x) for x in layout.split("x")[:2])
            if trainer_world % (tp * pp):
                continue
            for dst_tp in args.dst_tps:
                if args.generators % dst_tp:
                    continue
                if args.fp8:
                    out.append(Case(model, layout, dst_tp, torch.bfloat16, True))
                else:
                    out += [Case(model, layout, dst_tp, DTYPES[d], False) for d in args.dtypes]
    return out
