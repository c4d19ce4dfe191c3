"""A Flax Linen model trained as a 2-stage pipeline: the loss calls model.apply(params, x) as usual.

    python examples/flax_linen.py
"""

import jax

jax.config.update("jax_num_cpu_devices", 8)  # 8 fake devices on a CPU-only machine

import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import autopp  # noqa: E402


class Block(nn.Module):
    hidden: int

    @nn.compact
    def __call__(self, x):
        y = nn.Dense(4 * self.hidden)(nn.LayerNorm()(x))
        return x + nn.Dense(self.hidden)(nn.gelu(y))


class Model(nn.Module):
    hidden: int = 64
    depth: int = 4

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(self.hidden)(x)
        for _ in range(self.depth):
            x = Block(self.hidden)(x)
        return nn.Dense(4)(nn.LayerNorm()(x))


model = Model()
batch = (jax.random.normal(jax.random.key(1), (32, 16)), jax.random.normal(jax.random.key(2), (32, 4)))
params = model.init(jax.random.key(0), batch[0])
tx = optax.adam(1e-3)


def loss_fn(params, batch):
    x, y = batch
    return jnp.mean((model.apply(params, x) - y) ** 2)


def train_step(params, opt_state, batch):
    loss, grads = autopp.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


step = autopp.parallelize(train_step, num_stages=2, num_microbatches=4, schedule="1f1b",
                          devices=jax.devices()[:2])
opt_state = tx.init(params)
print(step.plan_for(params, opt_state, batch))
for i in range(3):
    params, opt_state, loss = step(params, opt_state, batch)
    print(f"step {i}: loss {float(loss):.5f}")
