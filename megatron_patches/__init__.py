"""Small, version-checked runtime patches to Megatron-Core.

Each patch module says why it exists and when it can be deleted. cpu_backend
and the two CPU speed patches never activate where CUDA is usable; tp_attributes
and optimizer_state correct upstream behaviour that is wrong on any device and
never change a value that is right.

    cpu_backend       run the unmodified Megatron-Core code on CPU + gloo
    single_rank_grad_sync  (installed by cpu_backend) DDP's reduce-scatter and
                      all-gather over a one-rank group are skipped: identities
                      gloo would run as a full copy of the grad buffer
    cpu_wgrad_accumulation  on CPU, weight gradients (linear layers and the word
                      embedding) accumulate into main_grad, as Megatron's
                      gradient_accumulation_fusion does on GPUs (trainer.setup.wrap_ddp)
    moe_cpu           (installed by cpu_backend) Megatron's MoE layers run without
                      Transformer Engine (the router's te_general_gemm name) and the
                      alltoall dispatcher's split sizes reach gloo as numbers;
                      its te_general_gemm fix alone also on GPUs without TE
                      (build_model_chunks, MoE models)
    tp_attributes     mark TP-sharded weights of models built without
                      initialisation (else grad-norm clipping is wrong at TP>1)
    optimizer_state   give each parameter its own Adam 'step' after a
                      distributed-optimizer load (torch Adam: no Apex/TE)
    checkpoint_writer the checkpoint writer's helper process dies with its
                      rank (else a killed job leaves it holding the job's pipes)
    jit_fuser         on CPU, Megatron-Core's import does not load torch.compile's
                      stack for fusions that never run there (installed by
                      ``import megarl``: ~3 s of CPU per rank process)
    lazy_wandb        Megatron-Core's import does not run wandb's (~1 s per rank
                      where wandb is installed); it runs on first use (installed
                      by ``import megarl``)

The names below are imported lazily: ``import megarl`` installs the two import hooks
through this package and must not pay for importing torch.
"""

__all__ = ["apply_cpu_backend", "cpu_device_mode", "is_active"]


def __getattr__(name):
    if name in __all__:
        from megatron_patches import cpu_backend  # lazily: it imports torch (see above)

        return {
            "apply_cpu_backend": cpu_backend.apply,
            "cpu_device_mode": cpu_backend.cpu_device_mode,
            "is_active": cpu_backend.is_active,
        }[name]
    raise AttributeError(f"module 'megatron_patches' has no attribute {name!r}")
