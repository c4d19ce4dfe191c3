"""Plain-JAX models (pure functions over dict pytrees) for tests, demos and benchmarks."""

from ._gpt import GPT, GPTConfig
from ._llama import Llama, LlamaConfig
from ._mlp import MLP, MLPConfig
from ._train import make_train_step

__all__ = ["GPT", "GPTConfig", "Llama", "LlamaConfig", "MLP", "MLPConfig", "make_train_step"]
