"""Seconds to push new weights from the trainer to every generator after a step.

Two prices: ``estimate`` (cheap, used while searching) takes the busier of the
two ends -- each generator GPU receiving its own shard over its NIC, or the
trainer GPUs sending one copy per generator replica between them -- which is
the bound megarl's shard-to-shard sync (DDMA, LlamaRL s.5.2) is built to reach.
``predict`` builds megarl's real transfer plan (``megarl.weight_sync.planner``)
and prices it with ``megarl.weight_sync.predict`` (the same as ``megarl bench
weight-sync --plan-only``); it needs torch and takes seconds for 405B (~7 s), so
it is run once for the chosen layout and cached per layout in this process.
"""

from __future__ import annotations

from functools import lru_cache

from megarl.models.spec import ModelSpec
from megarl.parallel_dims import GeneratorDims, ParallelDims
from megarl.plan.costs import H100CostModel
from megarl.plan.hardware import GB, Hardware, weight_bytes
from megarl.plan.inputs import TrainerLayout, runtime_generator


def estimate_seconds(costs: H100CostModel, trainer: TrainerLayout, generator: ParallelDims, precision: str) -> float:
    """The busier end: a generator GPU receiving its shard, or a trainer GPU sending its share of
    one copy per generator replica (``generator``: the planner's generators, dp = replicas)."""
    hw = costs.hw
    per_receiver = costs.generator_weight_bytes(generator, precision)
    shape = costs.shape
    model_bytes = shape.linear_params * weight_bytes(precision, "generator_precision")
    model_bytes += shape.embedding_params * 2.0 * (1 if shape.tied else 2)
    per_sender = generator.dp * model_bytes / trainer.gpus
    # Trainer and generator GPUs sit on different nodes: both ends go over the network.
    return max(per_receiver, per_sender) / (hw.network_gb_s * GB)


def predict_seconds(
    spec: ModelSpec, hw: Hardware, trainer: TrainerLayout, generator: ParallelDims, precision: str
) -> float:
    """megarl's transfer plan for these dims, priced (refused for a pipelined generator)."""
    t, g = trainer.dims, runtime_generator(generator)
    return _predict(
        spec, hw.gpus_per_node, hw.nvlink_gb_s, hw.network_gb_s, t.tp, t.pp, t.dp, g.tp, g.replicas, precision == "fp8"
    )


@lru_cache(maxsize=64)
def _predict(spec, gpus_per_node, nvlink_gb_s, network_gb_s, tp, pp, dp, gen_tp, replicas, fp8) -> float:
    # megarl.weight_sync imports torch (~2 s): megarl.plan imports without it (`megarl plan`'s search,
    # `megarl train`'s launcher, the dry run) and only a priced layout pays for it
    from megarl.weight_sync.planner import build_plan
    from megarl.weight_sync.predict import Links
    from megarl.weight_sync.predict import predict_seconds as plan_seconds

    trainer = ParallelDims(tp=tp, pp=pp, dp=dp)
    plan = build_plan(spec, trainer, GeneratorDims(tp=gen_tp, replicas=replicas))
    return plan_seconds(plan, fp8, Links(gpus_per_node, nvlink_gb_s, network_gb_s))
