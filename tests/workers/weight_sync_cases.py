"""The ordered list of sync cases both sides of the weight-sync test walk through.

Trainer layouts as lm_batch.parse_layout reads them (TPxPP[xVPP][eEP[tETP]]); generator
layouts TP[eEP] (SGLang's --tp and --ep-size)."""

import re
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
    dst_ep: int = 1

    @property
    def name(self) -> str:
        dtype = "fp8" if self.fp8 else str(self.dtype).removeprefix("torch.")
        ep = f"ep{self.dst_ep}" if self.dst_ep > 1 else ""
        return f"{self.model.rstrip('/').split('/')[-2]}:{self.layout}->tp{self.dst_tp}{ep}:{dtype}"


def trainer_sizes(layout: str):
    """(tp, pp, vpp, ep, etp or None) of a trainer layout string."""
    match = re.fullmatch(r"(\d+)x(\d+)(?:x(\d+))?(?:e(\d+)(?:t(\d+))?)?", layout)
    tp, pp, vpp, ep, etp = match.groups()
    return int(tp), int(pp), int(vpp or 1), int(ep or 1), None if etp is None else int(etp)


def generator_sizes(dst: str):
    """(tp, ep) of a generator layout string: "2", "2e2"."""
    tp, _, ep = str(dst).partition("e")
    return int(tp), int(ep or 1)


def cases(args, trainer_world: int):
    out = []
    for model in args.models:
        for layout in args.layouts:
            tp, pp = trainer_sizes(layout)[:2]
            if trainer_world % (tp * pp):
                continue
            for dst in args.dst_tps:
                dst_tp, dst_ep = generator_sizes(dst)
                if args.generators % dst_tp:
                    continue
                if args.fp8:
                    out.append(Case(model, layout, dst_tp, torch.bfloat16, True, dst_ep))
                else:
                    out += [Case(model, layout, dst_tp, DTYPES[d], False, dst_ep) for d in args.dtypes]
    return out
