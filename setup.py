"""megarl: a Megatron-Core backend for reinforcement learning of large language models."""

from setuptools import find_packages, setup

setup(
    name="megarl",
    version="0.1.0",
    description="Megatron-Core trainer + SGLang fp8 generators for asynchronous RL of Llama-family LLMs",
    python_requires=">=3.10",
    packages=find_packages(include=["megarl", "megarl.*", "megatron_patches", "megatron_patches.*"]),
    # the engine's C kernel is built from its source on the machine that runs it (torch_engine/native.py)
    package_data={"megarl.generator.torch_engine": ["*.c", "*.h"]},
    install_requires=[
        # Pinned: an unpinned torch pulls a multi-GB CUDA build onto CPU machines,
        # and megatron_patches is validated against exactly this pair.
        "torch==2.13.0",
        "megatron-core==0.16.1",
        "transformers>=5.0,<6",
        "safetensors>=0.4",
        "gguf>=0.10",  # transformers' GGUF loader
        "accelerate>=1.0",
        "numpy",
        "pyyaml",
        "tqdm",
        "tensorboard",
        "math-verify>=0.7",  # the math reward's answer checking
        "pyarrow",  # .parquet prompt sets
        "matplotlib",  # megarl plot: curves are part of the product
    ],
    extras_require={
        # GPU clusters. Apex is NOT listed: it is built from source
        # (https://github.com/NVIDIA/apex); the PyPI package named "apex" is an
        # unrelated project. Megatron-Core falls back to torch without it.
        "gpu": ["transformer-engine[pytorch]", "sglang"],
        # openai: the client the OpenAI-compatible endpoint (rollout.agent) is tested with
        "dev": ["pytest>=8", "pytest-timeout", "ruff==0.17.6", "import-linter==2.17", "openai>=1.40"],
        # run.wandb: Weights & Biases logging (offline mode needs no network); imported only when configured
        "wandb": ["wandb>=0.19"],
    },
    entry_points={"console_scripts": ["megarl=megarl.cli:main"]},
)
