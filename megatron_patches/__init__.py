"""Small, version-checked runtime patches to Megatron-Core.

Each patch module says why it exists and when it can be deleted. cpu_backend
never activates where CUDA is usable; the other two correct upstream behaviour
that is wrong on any device and never change a value that is right.

    cpu_backend       run the unmodified Megatron-Core code on CPU + gloo
    tp_attributes     mark TP-sharded weights of models built without
                      initialisation (else grad-norm clipping is wrong at TP>1)
    optimizer_state   give each parameter its own Adam 'step' after a
                      distributed-optimizer load (torch Adam: no Apex/TE)
    checkpoint_writer the checkpoint writer's helper process dies with its
                      rank (else a killed job leaves it holding the job's pipes)
"""

from megatron_patches.cpu_backend import apply as apply_cpu_backend
from megatron_patches.cpu_backend import cpu_device_mode, is_active

__all__ = ["apply_cpu_backend", "cpu_device_mode", "is_active"]
