"""ParallelDims / GeneratorDims: the rank formulas against Megatron-Core's own RankGenerator.

Megatron's parallel_state builds its groups with RankGenerator (order "tp-cp-ep-dp-pp", one
generator for the dense layers with ep=1, one for the experts with cp=1 and tp=etp); the
groups here must be the same lists in the same order. init_megatron also checks its rank's
groups against ParallelDims after every initialisation (runtime/distributed.py), so every
multi-rank test of the suite checks its own layout too.
"""

from __future__ import annotations

import pytest
from megatron.core.parallel_state import RankGenerator

from megarl.errors import ConfigError
from megarl.parallel_dims import GeneratorDims, ParallelDims, generator_rank

ORDER = "tp-cp-ep-dp-pp"  # initialize_model_parallel's default

# (tp, pp, dp, cp): the suite's layouts (TP1..TP3 conversions, TP2xPP2 training, DP4, PP2 with
# virtual stages, SmolLM2 at TP3, the 1024-rank dry run's TP8 x PP4) and a few with CP
DENSE = [
    (1, 1, 1, 1),
    (2, 1, 1, 1),
    (3, 1, 1, 1),
    (1, 2, 1, 1),
    (2, 2, 1, 1),
    (1, 1, 4, 1),
    (2, 1, 2, 1),
    (1, 2, 2, 1),
    (2, 2, 2, 1),
    (1, 4, 3, 1),
    (8, 4, 32, 1),
    (2, 1, 1, 2),
    (2, 2, 2, 2),
    (1, 3, 2, 4),
]
# (tp, pp, dp, cp, ep, etp)
EXPERT = [
    (1, 1, 4, 1, 2, None),
    (2, 1, 2, 1, 2, None),
    (2, 2, 4, 1, 4, 1),
    (4, 1, 2, 1, 2, 2),
    (2, 1, 2, 2, 4, 2),
    (8, 2, 4, 1, 8, 1),
]


def _megatron_dense(tp, pp, dp, cp):
    return RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=ORDER)


@pytest.mark.parametrize("tp,pp,dp,cp", DENSE)
def test_dense_groups_and_ranks_are_megatrons(tp, pp, dp, cp):
    dims = ParallelDims(tp=tp, pp=pp, dp=dp, cp=cp)
    ref = _megatron_dense(tp, pp, dp, cp)
    assert dims.world_size == ref.world_size == tp * pp * dp * cp
    for token in ("tp", "pp", "dp", "cp", "tp-pp", "dp-cp", "tp-cp", "tp-dp-cp", "tp-dp", "tp-cp-dp-pp"):
        assert dims.groups(token) == ref.get_ranks(token), token
    # the rank at given coordinates is the one in that TP, DP, PP group of Megatron's
    for rank in range(dims.world_size):
        c = dims.coords(rank)
        assert dims.rank(c["tp"], c["cp"], c["dp"], c["pp"]) == rank
        assert ref.get_ranks("tp")[sum(c[d] * s for d, s in _strides(dims, ("cp", "dp", "pp")))][c["tp"]] == rank
        assert ref.get_ranks("pp")[sum(c[d] * s for d, s in _strides(dims, ("tp", "cp", "dp")))][c["pp"]] == rank


def _strides(dims, names):
    sizes = dict(tp=dims.tp, cp=dims.cp, dp=dims.dp, pp=dims.pp)
    out, stride = [], 1
    for n in names:
        out.append((n, stride))
        stride *= sizes[n]
    return out


@pytest.mark.parametrize("tp,pp,dp,cp,ep,etp", EXPERT)
def test_expert_groups_are_megatrons(tp, pp, dp, cp, ep, etp):
    dims = ParallelDims(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, etp=etp)
    expert_tp = tp if etp is None else etp
    edp = tp * cp * dp // (expert_tp * ep)
    ref = RankGenerator(tp=expert_tp, ep=ep, dp=edp, pp=pp, cp=1, order=ORDER)
    assert dims.edp == edp and dims.world_size == ref.world_size  # ep, etp do not multiply in
    for ours, theirs in (("ep", "ep"), ("etp", "tp"), ("edp", "dp"), ("etp-ep", "tp-ep"), ("etp-ep-pp", "tp-ep-pp")):
        assert dims.expert_groups(ours) == ref.get_ranks(theirs), ours
    # the pipeline groups are the same in both layouts (Megatron asserts it)
    assert dims.expert_groups("pp") == dims.groups("pp")
    for rank in range(dims.world_size):
        c = dims.expert_coords(rank)
        assert dims.expert_rank(c["etp"], c["ep"], c["edp"], c["pp"]) == rank


def test_by_hand():
    # TP2 x DP2 x PP2: rank = tp + 2 (dp + 2 pp)
    dims = ParallelDims(tp=2, pp=2, dp=2)
    assert dims.rank(tp_rank=1, dp_rank=1, pp_rank=1) == 7
    assert dims.rank(tp_rank=1, dp_rank=0, pp_rank=1) == 5
    assert dims.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert dims.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert dims.virtual_pipeline_model_parallel_size is None
    assert ParallelDims(pp=2, vpp=3).virtual_pipeline_model_parallel_size == 3
    gen = GeneratorDims(tp=2, replicas=3)
    assert [gen.replica_of(r) for r in range(6)] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert gen.tp_groups() == [[0, 1], [2, 3], [4, 5]]
    assert generator_rank(dims, gen, replica=2, tp_rank=1) == 8 + 5


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(tp=0), "trainer.tp"),
        (dict(dp=-1), "trainer.dp"),
        (dict(pp=1, vpp=2), "trainer.vpp"),
        (dict(tp=2, dp=1, ep=4), "trainer.ep"),
        (dict(tp="2"), "trainer.tp"),
    ],
)
def test_errors_name_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        ParallelDims(**kwargs)


def test_generator_errors_name_the_field():
    with pytest.raises(ConfigError, match=r"generator\.replicas"):
        GeneratorDims(replicas=0)
    with pytest.raises(ConfigError, match=r"generator\.ep"):
        GeneratorDims(tp=4, ep=3)
