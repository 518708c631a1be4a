"""The first thing to run on a new multi-GPU node (scripts/cluster_check.sh): what one GPU without
network cannot show, each check a real `megarl` command, one JSON report.

- ``te_vs_local``: Transformer Engine's layer spec against the local one, one GPU each run: two
  `megarl train` runs of 2 sync steps, one per spec (``MEGARL_TRANSFORMER_ENGINE=1`` / ``=0``), one
  seed. Each spec is held against the same reference, the torch engine serving the weights that
  spec's trainer synced to it: step 1's trainer log-probabilities of the sampled tokens against the
  engine's (largest and mean difference, KL(mu || pi), ESS) -- the logits -- and the RL step's loss,
  gradient norm and step 2's KL side by side. (Megatron initialises each spec's modules in its own
  way, so the two runs need not sample the same tokens; where they did, their log-probabilities are
  also compared directly.)
- ``sglang_vs_engine``: `megarl train` with an SGLang server the job launches (bf16) against the
  same run with megarl's torch engine, 3 asynchronous steps at temperature 1e-4 (greedy but for
  exact ties): the responses generated under the same policy versions are compared token by token,
  those after a weight update counted apart.
- ``nccl_sync``: an asynchronous run with the trainer at TP gpus/2 and two generator replicas at
  TP gpus/4, so the weight sync goes shard to shard over NCCL between GPUs: bytes, seconds and GB/s
  per trainer rank, against ``--link-gb-s`` (the link's per-GPU bandwidth).
- ``async_vs_sync``: `megarl bench async-vs-sync` on all ``--gpus`` GPUs (async: a trainer of half
  of them, one generator replica per GPU of the other half; sync: every GPU both).

Each check runs its commands under its own time limit and is written into the report as soon as it
ends (ok, failed with the error's last lines, timeout, or skipped with why), so one failure leaves
the others. ``--dry`` writes the configs and the report with every command the check would run,
and starts nothing (the suite's check of this module). It has not run on a GPU cluster yet.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

CHECKS = ("te_vs_local", "sglang_vs_engine", "nccl_sync", "async_vs_sync")
GREEDY_TEMPERATURE = 1e-4  # RL configs need a temperature > 0; at 1e-4 sampling is the argmax but for ties


@dataclass
class Command:
    name: str  # the run it makes (its directory under the check's)
    argv: List[str]
    env: Dict[str, str] = field(default_factory=dict)


@dataclass
class Check:
    name: str
    gpus: int  # GPUs it needs
    commands: List[Command]
    figures: Callable[[Path], dict]  # the check's directory -> its figures (after every command ran)


def _jsonl(path: Path) -> list:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def _metrics(run: Path) -> list:
    return [m for m in _jsonl(run / "metrics.jsonl") if not m.get("eval")]


def base_config(a, out_dir: Path, mode: str, steps: int) -> dict:
    """A `megarl train` config needing only torch and megatron-core: a random model, token prompts."""
    return {
        "model": {"source": f"random:{a.preset}", "tokenizer": "none", "dtype": "bf16"},
        "trainer": {"tp": 1, "max_tokens_per_microbatch": 4096},
        "optimizer": {"lr": 1e-5},
        "generator": {"backend": "torch", "tp": 1, "replicas": 1, "dtype": "bf16", "max_seq_len": 512},
        "rollout": {"prompts_per_step": 8, "samples_per_prompt": 4, "max_new_tokens": 256, "temperature": 1.0},
        "reward": {"function": "synthetic_parity"},
        "data": {"train": "random:4096:1:256", "max_prompt_tokens": 256},
        "run": {
            "mode": mode,
            "steps": steps,
            "output_dir": str(out_dir),
            "progress": False,
            "seed": a.seed,
            "save_final": False,
        },
    }


def _train(config: dict, path: Path, name: str, **env) -> Command:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=1))
    return Command(name, [sys.executable, "-m", "megarl.cli", "train", "--config", str(path)], env)


# -- te_vs_local --------------------------------------------------------------------------------


def te_vs_local_commands(a, work: Path) -> List[Command]:
    commands = []
    for spec, switch in (("te", "1"), ("local", "0")):
        cfg = base_config(a, work / spec, "sync", 2)
        commands.append(_train(cfg, work / f"{spec}.json", spec, MEGARL_TRANSFORMER_ENGINE=switch))
    return commands


def _against_engine(run: Path) -> dict:
    """Step 1 of a sync run: the trainer's log pi of each sampled token against the engine's log mu,
    the engine holding the weights this trainer synced to it."""
    rows = [r for r in _jsonl(run / "rollouts.jsonl") if r["step"] == 1]
    diffs = [
        abs(x - y)
        for r in rows
        for x, y in zip(r["trainer_logprobs"], r["behaviour_logprobs"])
        if x is not None and y is not None
    ]
    if not diffs:
        raise ValueError(f"{run}: step 1 has no token with both log-probabilities")
    metrics = _metrics(run)
    out = {"tokens": len(diffs), "logprob_max_abs_diff": max(diffs), "logprob_mean_abs_diff": statistics.mean(diffs)}
    for key in ("kl_mu_pi", "ess", "loss", "grad_norm"):
        out[f"step1_{key}"] = metrics[0].get(key)
    out["step2_kl_mu_pi"] = metrics[1].get("kl_mu_pi") if len(metrics) > 1 else None
    return out


def compare_te_local(te: Path, local: Path) -> dict:
    out = {"te": _against_engine(te), "local": _against_engine(local)}
    one = [r for r in _jsonl(te / "rollouts.jsonl") if r["step"] == 1]
    two = [r for r in _jsonl(local / "rollouts.jsonl") if r["step"] == 1]
    same = bool(one) and [r["response_tokens"] for r in one] == [r["response_tokens"] for r in two]
    out["same_step1_samples"] = same
    if same:  # the specs initialised alike: their log-probabilities of the same tokens, directly
        out["te_minus_local_logprob_max_abs_diff"] = max(
            abs(x - y)
            for r, q in zip(one, two)
            for x, y in zip(r["trainer_logprobs"], q["trainer_logprobs"])
            if x is not None and y is not None
        )
    return out


# -- sglang_vs_engine ---------------------------------------------------------------------------


def sglang_vs_engine_commands(a, work: Path) -> List[Command]:
    commands = []
    for backend in ("sglang", "torch"):
        cfg = base_config(a, work / backend, "async", 3)
        cfg["rollout"].update(temperature=GREEDY_TEMPERATURE, max_lag=1)
        cfg["generator"]["backend"] = backend
        if backend == "sglang":
            cfg["generator"].update(sglang_port=a.sglang_port, sglang_mem_fraction=0.7, sglang_startup_timeout_s=900)
        commands.append(_train(cfg, work / f"{backend}.json", backend))
    return commands


def compare_greedy(sglang: Path, torch_engine: Path) -> dict:
    """Responses to the same prompt slot (step, position in the step) made under the same policy
    versions in both runs: equal token for token?"""

    def by_slot(run: Path) -> dict:
        out: dict = {}
        for r in _jsonl(run / "rollouts.jsonl"):
            step = out.setdefault(r["step"], [])
            step.append(r)
        return {(s, i): r for s, rows in out.items() for i, r in enumerate(rows)}

    one, two = by_slot(sglang), by_slot(torch_engine)
    compared = equal = after_update = equal_after_update = 0
    first_diffs = []
    for slot in sorted(one.keys() & two.keys()):
        r, s = one[slot], two[slot]
        if r["prompt_tokens"] != s["prompt_tokens"] or r["versions"] != s["versions"]:
            continue
        compared += 1
        same = r["response_tokens"] == s["response_tokens"]
        equal += same
        updated = max(r["versions"]) >= 1
        after_update += updated
        equal_after_update += same and updated
        if not same:
            first_diffs.append(
                next(
                    (i for i, (x, y) in enumerate(zip(r["response_tokens"], s["response_tokens"])) if x != y),
                    min(len(r["response_tokens"]), len(s["response_tokens"])),
                )
            )
    if not compared:
        raise ValueError(f"no response of {sglang} and {torch_engine} shares its prompt and policy versions")
    return {
        "compared": compared,
        "identical": equal,
        "identical_fraction": equal / compared,
        "compared_after_a_weight_update": after_update,
        "identical_after_a_weight_update": equal_after_update,
        "first_difference_positions": sorted(first_diffs)[:20],
    }


# -- nccl_sync ----------------------------------------------------------------------------------


def nccl_sync_commands(a, work: Path) -> List[Command]:
    cfg = base_config(a, work / "run", "async", 4)
    cfg["trainer"]["tp"] = a.gpus // 2
    cfg["generator"].update(tp=a.gpus // 4, replicas=2)
    return [_train(cfg, work / "run.json", "run")]


def sync_rate(run: Path, link_gb_s: float) -> dict:
    """The weight syncs of a run (the first left out: it carries the start-up's first connection)."""
    synced = [m for m in _metrics(run) if m.get("weight_sync_bytes")]
    if not synced:
        raise ValueError(f"{run}: no step synced weights")
    timed = synced[1:] or synced
    seconds = statistics.median(m["weight_sync_transfer_s"] for m in timed)
    gb = timed[0]["weight_sync_bytes"] / 1e9
    return {
        "syncs": len(synced),
        "GB_per_trainer_rank": gb,
        "seconds": seconds,
        "GB_per_s": gb / seconds,
        "link_GB_per_s": link_gb_s,
        "fraction_of_link": gb / seconds / link_gb_s,
        "step_sync_seconds": statistics.median(m["time_weight_sync"] for m in timed),
    }


# -- async_vs_sync ------------------------------------------------------------------------------


def async_vs_sync_commands(a, work: Path) -> List[Command]:
    half = a.gpus // 2
    cfg = base_config(a, work / "unused", "async", 6)
    cfg["trainer"].update(tp=1, dp=half)
    cfg["generator"].update(replicas=half)
    cfg["rollout"]["prompts_per_step"] = 4 * a.gpus  # divisible by the replicas and by sync's ranks
    path = work / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cfg, indent=1))
    argv = [sys.executable, "-m", "megarl.cli", "bench", "async-vs-sync", "--config", str(path)]
    return [Command("bench", argv + ["--workdir", str(work / "bench")])]


def async_vs_sync_figures(work: Path) -> dict:
    lines = [x for x in (work / "bench.out").read_text().splitlines() if x.startswith("{")]
    result = json.loads(lines[-1])
    keep = ("ranks", "steps", "measured_ratio", "ratio_async_over_sync", "composed_ratio", "async", "sync")
    return {k: result.get(k) for k in keep}


def plan(a, work: Path) -> List[Check]:
    return [
        Check(
            "te_vs_local",
            1,
            te_vs_local_commands(a, work / "te_vs_local"),
            lambda d: compare_te_local(d / "te", d / "local"),
        ),
        Check(
            "sglang_vs_engine",
            2,
            sglang_vs_engine_commands(a, work / "sglang_vs_engine"),
            lambda d: compare_greedy(d / "sglang", d / "torch"),
        ),
        Check(
            "nccl_sync", a.gpus, nccl_sync_commands(a, work / "nccl_sync"), lambda d: sync_rate(d / "run", a.link_gb_s)
        ),
        Check("async_vs_sync", a.gpus, async_vs_sync_commands(a, work / "async_vs_sync"), async_vs_sync_figures),
    ]


# -- running and the report ---------------------------------------------------------------------


def _tail(path: Path, lines: int = 20) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


def run_check(check: Check, work: Path, timeout_s: float, dry: bool) -> dict:
    """One check's entry in the report; its commands' output in <work>/<check>/<command>.out / .err."""
    where = work / check.name
    entry = {
        "check": check.name,
        "gpus": check.gpus,
        "commands": [{"name": c.name, "argv": c.argv, "env": c.env} for c in check.commands],
    }
    if dry:
        return {**entry, "status": "dry"}
    start = time.perf_counter()
    deadline = start + timeout_s
    for c in check.commands:
        out, err = where / f"{c.name}.out", where / f"{c.name}.err"
        with open(out, "w") as o, open(err, "w") as e:
            # its own session: a timeout ends the command and every rank and server it started
            proc = subprocess.Popen(c.argv, stdout=o, stderr=e, env={**os.environ, **c.env}, start_new_session=True)
            try:
                proc.wait(timeout=max(1.0, deadline - time.perf_counter()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return {**entry, "status": "timeout", "seconds": time.perf_counter() - start, "at": c.name}
        if proc.returncode != 0:
            return {
                **entry,
                "status": "failed",
                "seconds": time.perf_counter() - start,
                "at": c.name,
                "exit_code": proc.returncode,
                "error": _tail(err),
            }
    try:
        figures = check.figures(where)
    except Exception as exc:  # the runs ended but their outputs do not answer the check: say which
        return {**entry, "status": "failed", "seconds": time.perf_counter() - start, "error": repr(exc)}
    return {**entry, "status": "ok", "seconds": time.perf_counter() - start, "figures": figures}


def write_report(path: Path, header: dict, entries: List[dict]) -> dict:
    report = {**header, "checks": entries, "ok": sum(e["status"] == "ok" for e in entries)}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=1))
    tmp.replace(path)  # a reader never sees half a report
    return report


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus", type=int, default=8, help="GPUs on this node the checks may use (even, >= 4)")
    p.add_argument("--checks", default=",".join(CHECKS), help=f"comma-separated, of {', '.join(CHECKS)}")
    p.add_argument("--preset", default="llama3-1b", help="the random model's shape (megarl/models/presets.py)")
    p.add_argument("--link-gb-s", type=float, default=450.0, help="per-GPU link bandwidth the sync is read against")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="per check, all its commands together")
    p.add_argument("--sglang-port", type=int, default=30000)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--workdir", default="cluster_check", help="configs, runs and the report (report.json)")
    p.add_argument("--dry", action="store_true", help="write the configs and the planned commands; run nothing")
    a = p.parse_args(argv)
    chosen = [c.strip() for c in a.checks.split(",") if c.strip()]
    unknown = [c for c in chosen if c not in CHECKS]
    if unknown or not chosen:
        p.error(f"--checks: {', '.join(unknown) or 'none given'} not among {', '.join(CHECKS)}")
    if a.gpus < 4 or a.gpus % 4:
        p.error(f"--gpus {a.gpus}: a multiple of 4 (the sync check splits them into TP gpus/2 and 2 x TP gpus/4)")
    if a.link_gb_s <= 0 or a.timeout_s <= 0:
        p.error("--link-gb-s and --timeout-s must be > 0")
    a.checks = chosen
    return a


def main(argv=None) -> dict:
    a = parse_args(argv)
    work = Path(a.workdir).resolve()
    header = {"gpus": a.gpus, "preset": a.preset, "dry": a.dry, "link_GB_per_s": a.link_gb_s}
    if not a.dry:
        import torch

        header.update(
            device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            visible_gpus=torch.cuda.device_count(),
        )
    entries: List[dict] = []
    report = write_report(work / "report.json", header, entries)
    for check in plan(a, work):
        if check.name not in a.checks:
            continue
        visible: Optional[int] = header.get("visible_gpus")
        if visible is not None and visible < check.gpus:
            entries.append(
                {"check": check.name, "status": "skipped", "why": f"needs {check.gpus} GPUs, {visible} here"}
            )
        else:
            entries.append(run_check(check, work, a.timeout_s, a.dry))
        report = write_report(work / "report.json", header, entries)  # each check kept as it ends
    print(json.dumps(report), flush=True)
    return report


if __name__ == "__main__":
    main()
