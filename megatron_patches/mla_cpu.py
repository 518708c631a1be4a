"""Megatron-Core's multi-latent attention without Transformer Engine, and with YaRN RoPE on CPU:
two fixes, each a name.

Why this exists (both found building DeepSeek-V3's MLASelfAttention on CPU):

* ``HAVE_TE``: without TE, megatron.core.extensions.transformer_engine stands a MagicMock in for
  the ``transformer_engine`` module, so multi_latent_attention's ``try: from ...transformer_engine
  import TELinear`` succeeds, sets HAVE_TE True, and its constructor's ``isinstance(linear_proj,
  TELinear)`` raises TypeError (TELinear is a mock instance, not a type). Where TE cannot be imported
  the flag is set False: that branch (fp8 / fp4 with TE) is TE's only. Installed on any device
  without TE by megarl.models.megatron_model.build_model_chunks for MLA models.
* ``YarnRotaryEmbedding``
builds its frequencies inside ``with torch.device(torch.cuda.current_device())`` unless
``use_cpu_initialization``, and MLASelfAttention never passes that flag; cpu_backend's stand-in
current_device() is 0, and entering ``torch.device(0)`` raises "Cannot access accelerator device"
(the CudaToCpuMode rewrites device arguments, not a device context). On CPU the constructor here
asks for CPU initialisation, which builds the same frequencies on the CPU; the forward moves them
with ``.to(device=current_device())``, which the mode already sends to the CPU.

The second is installed by cpu_backend's apply (CPU processes only). When they can be deleted:
when MLA tests ``HAVE_TE`` by TE itself and passes ``use_cpu_initialization`` to its rotary
embedding.
Written for megatron-core 0.16.1 (cpu_backend warns on any other version).
"""

from __future__ import annotations

import importlib.util

_applied = False


def mark_te_absent() -> None:
    """MLA's TE-only branch off where Transformer Engine cannot be imported (any device)."""
    from megatron.core.transformer import multi_latent_attention

    if importlib.util.find_spec("transformer_engine") is None:
        multi_latent_attention.HAVE_TE = False


def apply() -> None:
    global _applied
    if _applied:
        return
    mark_te_absent()
    from megatron.core.models.common.embeddings import yarn_rotary_pos_embedding

    yarn = yarn_rotary_pos_embedding.YarnRotaryEmbedding
    own_init = yarn.__init__

    def __init__(self, *args, **kwargs):
        kwargs["use_cpu_initialization"] = True
        own_init(self, *args, **kwargs)

    yarn.__init__ = __init__
    _applied = True
