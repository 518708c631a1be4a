"""megatron_patches.cpu_backend in isolation (each scenario in a fresh process)."""

import json
import sys

from tests.conftest import WORKERS, run_command


def observe(scenario: str) -> dict:
    proc = run_command([sys.executable, WORKERS / "cpu_backend_checks.py", scenario])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_rewrites_cuda_requests_without_changing_math():
    out = observe("basic")
    assert out["first_apply"] and out["second_apply"] and out["idempotent"]
    assert out["math_unchanged"]
    assert out["is_available"] is False  # never faked: True would send Megatron into TE-only code
    assert out["zeros_device"] == "cpu" and out["int_device"] == "cpu" and out["to_cuda"] == "cpu,cpu"
    assert out["cuda_is_self"] and out["event_elapsed_ms_nonneg"]
    # Megatron's optimizers assert on these names.
    assert out["type_names"][:2] == ["torch.cuda.FloatTensor", "torch.cuda.BFloat16Tensor"]
    assert out["type_names"][2] == "torch.float16"
    # Custom backward functions run under the mode whichever autograd entry point started them.
    assert out["backward_grads"] == [[3.0] * 4, [3.0] * 4]  # the custom backward ran, cuda tensor and all
    assert out["tracker_reproducible"] and out["tracker_restores_outside_state"]
    assert out["thread_without_mode_fails"] and out["thread_with_mode_works"]


def test_never_activates_when_cuda_is_usable():
    assert observe("fake_cuda") == {"applied": False, "untouched": True, "mode_active": False}


def test_warns_clearly_on_another_megatron_version():
    out = observe("other_version")
    assert out["applied"]
    assert any("0.16.1" in m and "0.17.0" in m for m in out["messages"]), out["messages"]


def _jit_fuser_after_import(fake_cuda: bool) -> dict:
    code = (
        "import json, sys, torch\n"
        + ("torch.cuda.is_available = lambda: True\n" if fake_cuda else "")
        + "import megarl, megatron.core, megatron.core.jit as jit\n"
        "print(json.dumps({'compile': jit.jit_fuser is torch.compile, 'noop': jit.jit_fuser is jit.noop_decorator,\n"
        "                  'dynamo': 'torch._dynamo' in sys.modules}))\n"
    )
    return json.loads(run_command([sys.executable, "-c", code]).stdout.strip().splitlines()[-1])


def test_megatron_import_skips_torch_compile_on_cpu_only():
    # megatron_patches/jit_fuser.py: on CPU no fused function runs, so its import need not
    # load TorchDynamo (seconds per rank process); with CUDA, Megatron's fuser stays.
    assert _jit_fuser_after_import(fake_cuda=False) == {"compile": False, "noop": True, "dynamo": False}
    assert _jit_fuser_after_import(fake_cuda=True) == {"compile": True, "noop": False, "dynamo": True}


def _wandb_after_import(installed: bool) -> dict:
    code = (
        "import importlib.machinery, json, sys\n"
        + (
            ""
            if installed
            # wandb as if not installed: the path finder (ours defers to it) finds nothing
            else "real = importlib.machinery.PathFinder.find_spec\n"
            "importlib.machinery.PathFinder.find_spec = classmethod(\n"
            "    lambda cls, name, path=None, target=None: None if name == 'wandb' else real(name, path, target))\n"
        )
        + "import megarl, megatron.core, megatron.core.timers\n"
        "from megatron.core.inference.contexts import dynamic_context as dc\n"
        "from megatron_patches.lazy_wandb import is_deferred\n"
        "out = {'have_wandb': dc.HAVE_WANDB, 'deferred': is_deferred(), 'ran': 'wandb.sdk' in sys.modules}\n"
        "if dc.HAVE_WANDB:\n"
        "    import wandb\n"
        "    out.update(init=callable(wandb.init), ran_after_use='wandb.sdk' in sys.modules,\n"
        "               same=wandb is dc.wandb is megatron.core.timers.wandb, deferred_after_use=is_deferred())\n"
        "print(json.dumps(out))\n"
    )
    return json.loads(run_command([sys.executable, "-c", code]).stdout.strip().splitlines()[-1])


def test_megatron_import_defers_wandb_until_it_is_used():
    # megatron_patches/lazy_wandb.py: Megatron-Core's import runs `import wandb` (twice: its
    # inference context and its timers) for logging megarl never does -- ~1 s per rank process.
    # The module is bound (HAVE_WANDB stays True) but its body runs only at first use.
    assert _wandb_after_import(installed=True) == {
        "have_wandb": True,
        "deferred": True,
        "ran": False,
        "init": True,
        "ran_after_use": True,
        "same": True,
        "deferred_after_use": False,
    }
    # not installed: Megatron's ImportError fallback, as without the patch
    assert _wandb_after_import(installed=False) == {"have_wandb": False, "deferred": False, "ran": False}
