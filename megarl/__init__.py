"""megarl: a Megatron-Core backend for reinforcement learning of large language models."""

__version__ = "0.1.0"

# Before anything imports Megatron-Core: on CPU its import would load torch.compile's
# stack for fusions megarl never runs there (~3 s per rank process; see the patch).
# Likewise its import runs wandb's (~1 s per rank) where wandb is installed: deferred to first use.
from megatron_patches.jit_fuser import install as _install_jit_fuser_hook  # noqa: E402
from megatron_patches.lazy_wandb import install as _install_lazy_wandb  # noqa: E402

_install_jit_fuser_hook()
_install_lazy_wandb()
