"""The RL loop end to end: config, topology, and `megarl train` in async and sync modes.

The end-to-end runs use configs/tiny_cpu.yaml: a tiny random Llama with
SmolLM2's tokenizer, trainer TP2 (2 ranks) + 1 generator rank in async mode,
4 colocated ranks (trainer TP2 x PP2, each with its own engine) in sync mode,
arithmetic prompts scored by a test reward a random model earns about half of the time.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megarl.config import load_config
from megarl.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


TINY = str(ROOT / "configs" / "tiny_cpu.yaml")


def test_config_errors_name_the_field(tmp_path):
    cfg = load_config(
        TINY,
        [
            "optimizer.lr=3e-4",
            "generator.backend=sglang",
            "generator.replicas=2",
            "generator.sglang_urls=http://a:1,http://b:2",
        ],
    )
    assert cfg.optimizer.lr == 3e-4 and cfg.generator.sglang_urls == ["http://a:1", "http://b:2"]
    cases = {
        "trainer.tp=two": "trainer.tp: expected an integer",
        "trainer.tpp=2": "trainer.tpp: unknown field",
        "run.mode=fast": "run.mode: 'fast' is not one of",
        "rollout.prompts_per_step=0": "rollout.prompts_per_step: must be >= 1",
        "rollout.temperature=0": "rollout.temperature: RL needs sampling",
        "generator.max_seq_len=64": "generator.max_seq_len=64 <",
        "reward=3": "reward: expected a section",
        # a field is used or refused: SGLang's settings with the torch engine, a URL per replica
        "generator.sglang_urls=http://a:1": "generator.sglang_urls: used only with generator.backend=sglang",
        "generator.sglang_mem_fraction=0.5": "generator.sglang_mem_fraction: used only with",
        "model.tokenizer=none": "model.tokenizer: none is for random:<preset> models|data.train: with model.tokenizer",
    }
    sglang = ["generator.backend=sglang"]
    sglang_cases = {
        "generator.sglang_urls=http://a:1,http://b:2": "2 URLs for generator.replicas=1",
        "generator.sglang_urls=a:1": "generator.sglang_urls\\[0\\]: 'a:1' is not an http",
        "generator.recompute_kv_on_update=true": "generator.recompute_kv_on_update: SGLang keeps the KV cache",
        "run.mode=sync": "run.mode: sync \\(colocated\\) runs the torch engine",
    }
    with pytest.raises(ConfigError, match="generator.verify_sync: sync mode copies"):
        load_config(TINY, ["run.mode=sync", "generator.verify_sync=true"])
    for override, message in sglang_cases.items():
        with pytest.raises(ConfigError, match=message):
            load_config(TINY, [*sglang, override])
    for override, message in cases.items():
        with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
            load_config(TINY, [override])
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(str(bad))


def test_topology_assigns_every_rank_once():
    cfg = load_config(TINY, ["trainer.dp=2", "generator.tp=2", "generator.replicas=2"])
    topo = cfg.layout().topology()
    assert topo.world_size == 8
    assert topo.executors == {"trainer": (0, 1, 2, 3), "generator": (4, 5, 6, 7), "reward": (4, 6)}
    assert topo.trainer_groups()["tp"] == [[0, 1], [2, 3]] and topo.trainer_groups()["dp"] == [[0, 2], [1, 3]]
    assert topo.generator_tp_groups() == [[4, 5], [6, 7]] and topo.replica_of(7) == (1, 1)
    assert len(topo.check(gpus_per_node=4)) == 4
    # ranks 0-1 trainer, [2, 3] and [4, 5] generator replicas: [2, 3] straddles nodes of 3 GPUs
    with pytest.raises(ConfigError, match="generator TP group \\[2, 3\\] spans nodes"):
        load_config(TINY, ["generator.tp=2", "generator.replicas=2"]).layout().topology().check(gpus_per_node=3)
    sync = load_config(TINY, ["run.mode=sync"]).layout().topology()
    assert sync.executors == {"trainer": (0, 1), "generator": (0, 1), "reward": (0, 1)}
    assert [c.name for c in sync.channels] == ["rollouts", "batch", "weights"]
