"""Plain-JAX models (pure functions over dict pytrees) for tests, demos and benchmarks."""

from ._gpt import GPT, GPTConfig
from ._mlp import MLP, MLPConfig

__all__ = ["GPT", "GPTConfig", "MLP", "MLPConfig"]
