"""The run's layout (megarl/layout.py): the one place that derives the job's world size and lag bound.

Two kinds of checks: RunLayout's numbers against sizes counted by hand, and a scan of megarl/
showing that no other module computes them again (a copy would drift: before this module the world
size was written three times and the lag bound twice). The scan reads code only -- strings and
comments are blanked -- and each of its patterns is shown to catch the copies it replaced.
"""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest

from megarl.config import load_config
from megarl.errors import ConfigError
from megarl.layout import RunLayout
from megarl.parallel_dims import GeneratorDims, ParallelDims

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny_cpu.yaml")

# -- the numbers ------------------------------------------------------------------------------------


def _layout(mode, backend="torch", max_lag=3, updates_per_batch=1):
    # trainer TP2 x DP2 = 4 ranks; generators 3 replicas of TP2 = 6 ranks
    return RunLayout(
        mode, backend, ParallelDims(tp=2, dp=2), GeneratorDims(tp=2, replicas=3), max_lag, updates_per_batch
    )


def test_async_job_is_trainer_then_generators_and_lags_up_to_max_lag():
    layout = _layout("async")
    assert (layout.world_size, layout.lag_bound, layout.steps_ahead) == (10, 3, 3)
    assert (layout.colocated, layout.server_generators) == (False, False)
    topo = layout.topology()
    assert (topo.world_size, topo.executors["generator"]) == (10, (4, 5, 6, 7, 8, 9))


def test_sync_job_is_the_trainers_ranks_and_lags_g_minus_1():
    layout = _layout("sync", updates_per_batch=4)
    # the configured generators are not ranks of a colocated job: each trainer rank runs a TP-1 engine
    assert (layout.world_size, layout.lag_bound, layout.steps_ahead) == (4, 3, 1)
    assert layout.topology().executors["generator"] == (0, 1, 2, 3)


def test_sglang_servers_gpus_count_in_the_job():
    layout = _layout("async", backend="sglang")
    assert layout.server_generators and layout.world_size == 10 and layout.topology().drivers_only


def test_config_asks_the_layout():
    cfg = load_config(TINY, ["trainer.dp=2", "generator.tp=2", "generator.replicas=2", "rollout.max_lag=5"])
    assert (cfg.layout().world_size, cfg.layout().lag_bound) == (2 * 2 + 2 * 2, 5)


@pytest.mark.parametrize(
    "mode, backend, field", [("fast", "torch", "run.mode"), ("async", "vllm", "generator.backend")]
)
def test_an_unknown_mode_or_backend_is_refused_by_its_field(mode, backend, field):
    with pytest.raises(ConfigError, match=f"^{re.escape(field)}: "):
        _layout(mode, backend)


# -- no copy elsewhere ------------------------------------------------------------------------------

# what computing the world size or the lag bound, or deciding what run.mode means, looks like in code
COPIES = {
    "a world size summed from the trainer's and the generators'": re.compile(r"world_size\s*\+\s*[\w.()]*world_size"),
    "sync mode's lag bound": re.compile(r"updates_per_batch\s*-\s*1\b"),
    "run.mode compared (config.py validates it; the rest ask the layout)": re.compile(r"\brun\.mode\s*(==|!=|\bin\b)"),
}
MODE_READERS = {"megarl/config.py"}  # where comparing run.mode is validation, not layout


def _code(source: str) -> str:
    """The source with every string and comment blanked, lines kept (a message may name a formula)."""
    lines = source.splitlines()
    blank = {tokenize.STRING, tokenize.COMMENT} | {
        getattr(tokenize, n) for n in ("FSTRING_MIDDLE",) if hasattr(tokenize, n)
    }
    for tok in reversed(list(tokenize.generate_tokens(io.StringIO(source).readline))):
        if tok.type not in blank:
            continue
        (r0, c0), (r1, c1) = tok.start, tok.end
        if r0 == r1:
            line = lines[r0 - 1]
            lines[r0 - 1] = line[:c0] + "S" + line[c1:]
        else:
            lines[r0 - 1] = lines[r0 - 1][:c0] + "S"
            for r in range(r0, r1 - 1):
                lines[r] = ""
            lines[r1 - 1] = lines[r1 - 1][c1:]
    return "\n".join(lines)


def copies_in(path: str, source: str) -> list:
    found = []
    for n, line in enumerate(_code(source).splitlines(), 1):
        for what, pattern in COPIES.items():
            if what.startswith("run.mode") and path in MODE_READERS:
                continue
            if pattern.search(line):
                found.append(f"{path}:{n}: {what}: {line.strip()}")
    return found


def test_no_module_but_the_layout_computes_the_world_size_or_the_lag_bound():
    found = []
    for p in sorted((ROOT / "megarl").rglob("*.py")):
        rel = p.relative_to(ROOT).as_posix()
        if rel != "megarl/layout.py":
            found += copies_in(rel, p.read_text())
    assert found == []


# the copies this module replaced, verbatim (lines flagged), and what replaced them: the scan must
# flag each copy and pass its replacement
FORMER = {
    "megarl/config.py": (
        'if self.run.mode == "sync":\n    return self.trainer_dims().world_size\n'
        "return self.trainer_dims().world_size + self.generator_dims().world_size\n",
        "return self.layout().world_size\n",
        1,  # the sum (config.py may compare run.mode: it validates it)
    ),
    "megarl/plan/config_plan.py": (
        'if cfg.run.mode == "sync":\n    return cfg.trainer_dims().world_size\n'
        "return cfg.trainer_dims().world_size + cfg.generator_dims().world_size\n"
        'return float(max(cfg.rollout.max_lag, 1)) if cfg.run.mode == "async" else 1.0\n',
        "used = cfg.layout().world_size\nreturn float(cfg.layout().steps_ahead)\n",
        3,
    ),
    "megarl/loop/wiring.py": (
        'return cfg.run.mode == "sync"\n'
        "return cfg.trainer.updates_per_batch - 1 if _colocated(cfg) else cfg.rollout.max_lag\n",
        "trainer = TrainerExecutor(cfg, prepared, resume_dir, layout.lag_bound, on_gpu=on_gpu)\n",
        2,
    ),
    "megarl/layout.py (Topology.disaggregated, before disaggregated_world_size)": (
        "gen = tuple(range(trainer.world_size, trainer.world_size + generator.world_size))\n",
        "gen = tuple(range(trainer.world_size, world))\n",
        1,
    ),
    "megarl/trainer/features.py": ('if cfg.run.mode == "sync":\n', "if cfg.layout().colocated:\n", 1),
}


@pytest.mark.parametrize("path", list(FORMER))
def test_the_scan_flags_each_former_copy_and_passes_its_replacement(path):
    before, after, flagged = FORMER[path]
    assert len(copies_in(path, before)) == flagged
    assert copies_in(path, after) == []


def test_the_scan_reads_code_not_messages_or_comments():
    message = 'raise ConfigError("trained up to trainer.updates_per_batch - 1 versions later")  # run.mode == sync\n'
    assert copies_in("megarl/x.py", message) == []
    assert copies_in("megarl/x.py", "lag = t.updates_per_batch - 1\n") != []
