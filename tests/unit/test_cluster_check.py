"""megarl/bench/cluster_check.py's parts that run without GPUs: its arguments, the configs it plans
(each a valid megarl run config at a layout the model divides), and the comparisons that turn the
runs' files into the report's figures, on files written here with known numbers."""

import json
from pathlib import Path

import pytest

from megarl.bench import cluster_check
from megarl.config import config_from_dict
from megarl.models.megatron_model import transformer_engine_usable
from megarl.models.presets import preset_spec


def test_arguments_and_their_refusals(capsys):
    a = cluster_check.parse_args([])
    assert a.gpus == 8 and a.checks == list(cluster_check.CHECKS) and a.link_gb_s == 450.0
    assert cluster_check.parse_args(["--checks", "nccl_sync, te_vs_local"]).checks == ["nccl_sync", "te_vs_local"]
    for argv, message in (
        (["--checks", "nccl_sync,speed"], "--checks: speed not among"),
        (["--gpus", "6"], "--gpus 6: a multiple of 4"),
        (["--link-gb-s", "0"], "--link-gb-s and --timeout-s must be > 0"),
    ):
        with pytest.raises(SystemExit):
            cluster_check.parse_args(argv)
        assert message in capsys.readouterr().err


@pytest.mark.parametrize("gpus", [4, 8])
def test_every_planned_run_is_a_valid_config_at_a_layout_the_model_divides(tmp_path, gpus):
    a = cluster_check.parse_args(["--gpus", str(gpus)])
    spec = preset_spec(a.preset)
    checks = cluster_check.plan(a, tmp_path)
    assert [c.name for c in checks] == list(cluster_check.CHECKS)
    configs = sorted(tmp_path.rglob("*.json"))
    assert len(configs) == 2 + 2 + 1 + 1
    for path in configs:
        cfg = config_from_dict(json.loads(path.read_text()))
        t, g = cfg.trainer, cfg.generator
        spec.check_parallelism(t.tp)
        spec.check_parallelism(g.tp)
        assert cfg.layout().world_size <= gpus, path
    nccl = config_from_dict(json.loads((tmp_path / "nccl_sync" / "run.json").read_text()))
    assert (nccl.trainer.tp, nccl.generator.tp, nccl.generator.replicas) == (gpus // 2, gpus // 4, 2)
    assert nccl.layout().world_size == gpus  # every GPU in the sync: trainer shards to generator shards
    bench = json.loads((tmp_path / "async_vs_sync" / "config.json").read_text())
    # the bench's sync run puts every rank in the trainer's data parallel group: its batch divides
    assert config_from_dict(bench).layout().world_size == gpus
    assert bench["rollout"]["prompts_per_step"] % gpus == 0
    te = {c.name: c for c in checks[0].commands}
    assert te["te"].env == {"MEGARL_TRANSFORMER_ENGINE": "1"} and te["local"].env == {"MEGARL_TRANSFORMER_ENGINE": "0"}
    for name in ("te", "local"):  # one seed, one mode: the runs differ by their layer spec alone
        cfg = json.loads((tmp_path / "te_vs_local" / f"{name}.json").read_text())
        assert cfg["run"]["seed"] == a.seed and cfg["run"]["mode"] == "sync"
    assert json.loads((tmp_path / "te_vs_local" / "te.json").read_text()) == {
        **json.loads((tmp_path / "te_vs_local" / "local.json").read_text()),
        "run": {**cfg["run"], "output_dir": str(tmp_path / "te_vs_local" / "te")},
    }


def test_the_transformer_engine_switch(monkeypatch):
    monkeypatch.setenv("MEGARL_TRANSFORMER_ENGINE", "0")
    assert transformer_engine_usable() is False
    monkeypatch.setenv("MEGARL_TRANSFORMER_ENGINE", "1")  # this machine has no CUDA GPU
    with pytest.raises(RuntimeError, match="MEGARL_TRANSFORMER_ENGINE=1: Transformer Engine is not usable here"):
        transformer_engine_usable()
    monkeypatch.setenv("MEGARL_TRANSFORMER_ENGINE", "yes")
    with pytest.raises(ValueError, match="MEGARL_TRANSFORMER_ENGINE='yes'"):
        transformer_engine_usable()


def _write(run: Path, rollouts: list, metrics: list) -> Path:
    run.mkdir(parents=True)
    (run / "rollouts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rollouts))
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    return run


def _rollout(step, prompt, response, versions, logprobs=None, behaviour=None):
    return dict(
        step=step,
        prompt_tokens=prompt,
        response_tokens=response,
        versions=versions,
        trainer_logprobs=logprobs,
        behaviour_logprobs=behaviour,
    )


def test_each_spec_against_the_engine_it_synced(tmp_path):
    te = _write(
        tmp_path / "te",
        [
            _rollout(1, [1], [5, 6], [0, 0], [-1.0, -2.0], [-1.001, -2.0]),
            _rollout(1, [2], [7], [0], [-0.5], [-0.502]),
            _rollout(2, [3], [8], [1], [-3.0], [-1.0]),  # step 2: after an update, not the check
        ],
        [dict(step=1, kl_mu_pi=1e-4, ess=0.999, loss=0.30, grad_norm=2.2), dict(step=2, kl_mu_pi=2e-4)],
    )
    local = _write(
        tmp_path / "local",
        [_rollout(1, [1], [5, 9], [0, 0], [-1.0, None], [-1.004, -2.0])],  # a masked token: no log pi
        [dict(step=1, kl_mu_pi=3e-4, ess=0.998, loss=0.31, grad_norm=2.0)],
    )
    got = cluster_check.compare_te_local(te, local)
    assert got["te"]["tokens"] == 3 and got["te"]["logprob_max_abs_diff"] == pytest.approx(0.002)
    assert got["te"]["logprob_mean_abs_diff"] == pytest.approx((0.001 + 0.0 + 0.002) / 3)
    assert (got["te"]["step1_kl_mu_pi"], got["te"]["step1_grad_norm"], got["te"]["step2_kl_mu_pi"]) == (1e-4, 2.2, 2e-4)
    assert got["local"]["tokens"] == 1 and got["local"]["logprob_max_abs_diff"] == pytest.approx(0.004)
    assert got["local"]["step2_kl_mu_pi"] is None  # the run has one step
    assert got["same_step1_samples"] is False and "te_minus_local_logprob_max_abs_diff" not in got
    # where both specs sampled the same tokens, they are also compared directly
    twin = _write(
        tmp_path / "twin",
        [_rollout(1, [1], [5, 6], [0, 0], [-1.03, -2.0], [-1.0, -2.0]), _rollout(1, [2], [7], [0], [-0.5], [-0.5])],
        [dict(step=1)],
    )
    direct = cluster_check.compare_te_local(te, twin)
    assert direct["same_step1_samples"] is True
    assert direct["te_minus_local_logprob_max_abs_diff"] == pytest.approx(0.03)
    empty = _write(tmp_path / "empty", [_rollout(1, [1], [5], [0], [None], [-1.0])], [dict(step=1)])
    with pytest.raises(ValueError, match="step 1 has no token with both log-probabilities"):
        cluster_check.compare_te_local(te, empty)


def test_greedy_tokens_compared_where_prompt_and_versions_agree(tmp_path):
    sglang = _write(
        tmp_path / "sglang",
        [
            _rollout(1, [1, 2], [5, 6, 7], [0, 0, 0]),
            _rollout(1, [3], [8, 9], [0, 0]),
            _rollout(2, [4], [1, 2, 3, 4], [1, 1, 1, 1]),
            _rollout(2, [5], [6], [1]),
        ],
        [],
    )
    engine = _write(
        tmp_path / "torch",
        [
            _rollout(1, [1, 2], [5, 6, 7], [0, 0, 0]),
            _rollout(1, [3], [8, 9], [0, 1]),  # an in-flight update at another moment: not compared
            _rollout(2, [4], [1, 2, 0, 4], [1, 1, 1, 1]),  # differs at position 2
            _rollout(2, [5], [6], [1]),
        ],
        [],
    )
    got = cluster_check.compare_greedy(sglang, engine)
    assert got == {
        "compared": 3,
        "identical": 2,
        "identical_fraction": 2 / 3,
        "compared_after_a_weight_update": 2,
        "identical_after_a_weight_update": 1,
        "first_difference_positions": [2],
    }


def test_sync_rate_leaves_the_first_sync_out(tmp_path):
    def m(step, nbytes, seconds):
        return dict(
            step=step, weight_sync_bytes=nbytes, weight_sync_transfer_s=seconds, time_weight_sync=seconds + 0.01
        )

    run = _write(tmp_path / "run", [], [m(1, 3e9, 1.0), m(2, 3e9, 0.02), m(3, 3e9, 0.03), m(4, 0, 0.0)])
    got = cluster_check.sync_rate(run, 450.0)
    assert got["syncs"] == 3 and got["seconds"] == 0.025 and got["GB_per_trainer_rank"] == 3.0
    assert got["GB_per_s"] == pytest.approx(120.0) and got["fraction_of_link"] == pytest.approx(120.0 / 450.0)
    with pytest.raises(ValueError, match="no step synced weights"):
        cluster_check.sync_rate(_write(tmp_path / "none", [], [m(1, 0, 0.0)]), 450.0)
