"""The trainer's and optimizer's config sections: every value reaches Megatron or the loss, or is refused.

Loss parameters: for each built-in loss and each parameter, the per-token loss the
forward-step hook computes from a loaded config equals the loss's formula written
out here with the configured value, and differs from what the default would give
(so a dropped parameter fails). Megatron settings: the TransformerConfig and
optimizer a config builds carry its values.
"""


def test_the_config_imports_nothing_of_the_trainer():
    # the config is the bottom layer: the loss is checked against the config, never the other way
    import subprocess
    import sys

    code = "import sys, megarl.config; print(sorted(m for m in sys.modules if m.startswith('megarl.trainer')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
