"""Shared handling for command-line entry points: user errors print one line, exit 2."""

from __future__ import annotations

import logging
import os
import re
import sys
import warnings
from typing import Callable

from megarl.errors import MegarlError

# Upstream notices that are expected on every CPU run and say nothing about the
# user's job (missing TE/Apex on CPU, deprecations inside Megatron/torch).
# Prefixes of the messages; no commas or colons (PYTHONWARNINGS syntax).
EXPECTED_UPSTREAM_WARNINGS = (
    "Transformer Engine and Apex are not installed",
    "Apex is not installed",
    "full scope is deprecated",
    "When using async grad allreduce",
    "Please use DTensor instead",
    "`torch.distributed.all_gather_into_tensor` is deprecated",
    "`load_state_dict` is deprecated",
    "`save_state_dict` is deprecated",
    "The .grad attribute of a Tensor that is not a leaf",
)


def quiet_third_party_warnings() -> None:
    for prefix in EXPECTED_UPSTREAM_WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(prefix))
    # Spawned ranks do not inherit filters, only the environment.
    extra = ",".join(f"ignore:{prefix}" for prefix in EXPECTED_UPSTREAM_WARNINGS)
    current = os.environ.get("PYTHONWARNINGS")
    os.environ["PYTHONWARNINGS"] = f"{current},{extra}" if current else extra
    logging.getLogger("megatron").setLevel(logging.WARNING)


def run_tool(main: Callable[[], None]) -> int:
    quiet_third_party_warnings()
    try:
        main()
    except MegarlError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        # Ctrl-C before the ranks started (or in a command without them): nothing to save yet. Once
        # ranks run, Ctrl-C saves a checkpoint at the next step boundary (runtime/preemption.py)
        print("megarl: interrupted (Ctrl-C)", file=sys.stderr, flush=True)
        return 130
    return 0
