"""A Flax NNX model trained as a 2-stage pipeline: split the module into (graphdef, state), differentiate the
state, and rebuild the module inside the loss with nnx.merge.

    python examples/flax_nnx.py
"""

import jax

jax.config.update("jax_num_cpu_devices", 8)  # 8 fake devices on a CPU-only machine

import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import autopp  # noqa: E402


class MLP(nnx.Module):
    def __init__(self, din, hidden, dout, depth, rngs: nnx.Rngs):
        self.inp = nnx.Linear(din, hidden, rngs=rngs)
        self.blocks = nnx.List([nnx.Linear(hidden, hidden, rngs=rngs) for _ in range(depth)])
        self.norm = nnx.LayerNorm(hidden, rngs=rngs)
        self.out = nnx.Linear(hidden, dout, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.inp(x))
        for block in self.blocks:
            x = x + nnx.gelu(block(x))
        return self.out(self.norm(x))


graphdef, state = nnx.split(MLP(16, 64, 4, depth=4, rngs=nnx.Rngs(0)))
tx = optax.adam(1e-3)


def loss_fn(state, batch):
    model = nnx.merge(graphdef, state)  # pure: the module is rebuilt from the (traced) state
    x, y = batch
    return jnp.mean((model(x) - y) ** 2)


def train_step(state, opt_state, batch):
    loss, grads = autopp.value_and_grad(loss_fn)(state, batch)
    updates, opt_state = tx.update(grads, opt_state, state)
    return optax.apply_updates(state, updates), opt_state, loss


step = autopp.parallelize(train_step, num_stages=2, num_microbatches=4, schedule="1f1b",
                          devices=jax.devices()[:2])
batch = (jax.random.normal(jax.random.key(1), (32, 16)), jax.random.normal(jax.random.key(2), (32, 4)))
opt_state = tx.init(state)
print(step.plan_for(state, opt_state, batch))
for i in range(3):
    state, opt_state, loss = step(state, opt_state, batch)
    print(f"step {i}: loss {float(loss):.5f}")
# The state comes back on its stages' devices; gathered onto one, it is an ordinary module for evaluation.
model = nnx.merge(graphdef, autopp.gather(state))
print(f"evaluation loss {float(jnp.mean((model(batch[0]) - batch[1]) ** 2)):.5f}")
