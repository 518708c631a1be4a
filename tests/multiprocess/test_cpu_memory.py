"""runtime/cpu_memory.py: freed large tensors are reused, not faulted in again page by page."""

import os
import subprocess
import sys

# A training step's pattern: vocabulary-sized temporaries (fp32 [480, 49152], 94 MB each)
# made and freed every micro-batch. glibc's memalign (torch's CPU allocator) takes a few rounds
# to settle on reusing freed heap blocks; the last rounds are the steady state.
PROBE = r"""
import resource, sys, torch
from megarl.runtime import cpu_memory
if sys.argv[1] == "keep":
    assert cpu_memory.keep_freed_memory()
x = torch.ones(480, 49152)
faults = []
for _ in range(8):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    y = x.exp()
    z = y * x
    del y, z
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(faults[-1] + faults[-2])
if sys.argv[1] == "keep":  # release: the freed 2 x 94 MB go back to the kernel
    statm = lambda: int(open("/proc/self/statm").read().split()[1]) * 4096
    held = statm()
    cpu_memory.release_freed_memory()
    assert held - statm() >= 150 << 20, (held, statm())
"""


def faults(mode: str) -> int:
    env = {"MEGARL_MALLOC_KEEP": "0"} if mode == "default" else {}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True, env={**os.environ, **env}
    )
    return int(out.stdout.strip().splitlines()[-1])


def test_vocabulary_sized_temporaries_are_reused_without_page_faults():
    pages = 2 * 2 * 480 * 49152 * 4 // 4096  # two rounds of two 94 MB tensors
    default, kept = faults("default"), faults("keep")
    assert default >= 0.9 * pages  # glibc mmaps and unmaps each one: every page faulted again
    assert kept <= 0.05 * pages  # kept in the heap: the same pages, no new faults
