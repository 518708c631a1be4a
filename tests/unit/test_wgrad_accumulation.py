"""On CPU, weight gradients accumulate into main_grad (megatron_patches/cpu_wgrad_accumulation.py) and
DDP's one-rank collectives are skipped (megatron_patches/single_rank_grad_sync.py): the gradients
equal those of Megatron's own unfused path and gloo reduce-scatter, for tied and untied embeddings,
in fp32 and bf16, accumulated over three packed micro-batches."""


def test_gradient_accumulation_fusion_setting():
    """trainer.gradient_accumulation_fusion: unset = wherever the kernel exists (every CPU run; a GPU only
    with Apex's extension, which no CPU machine has), false = off, true on a GPU without Apex = refused."""
    import importlib.util

    import pytest

    from megarl.errors import ConfigError
    from megarl.trainer.features import gradient_accumulation_fusion

    assert importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is None  # Apex is a GPU cluster's build
    assert gradient_accumulation_fusion(None, on_gpu=False) and gradient_accumulation_fusion(True, on_gpu=False)
    assert not gradient_accumulation_fusion(False, on_gpu=False)
    assert not gradient_accumulation_fusion(None, on_gpu=True) and not gradient_accumulation_fusion(False, on_gpu=True)
    with pytest.raises(ConfigError, match=r"trainer\.gradient_accumulation_fusion: true needs Apex"):
        gradient_accumulation_fusion(True, on_gpu=True)
