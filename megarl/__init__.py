"""megarl: a Megatron-Core backend for reinforcement learning of large language models."""

__version__ = "0.1.0"
