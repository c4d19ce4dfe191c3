"""An Equinox module trained as a 2-stage pipeline. As with jax.jit, the step takes arrays only: partition the
module into its floating-point arrays and the rest (functions such as activations, static fields), pass the
arrays, and recombine inside the loss.

    python examples/equinox_model.py
"""

import jax

jax.config.update("jax_num_cpu_devices", 8)  # 8 fake devices on a CPU-only machine

import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import autopp  # noqa: E402


class Model(eqx.Module):
    norm: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP
    out: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.norm = eqx.nn.LayerNorm(16)
        self.mlp = eqx.nn.MLP(16, 64, 64, depth=4, activation=jax.nn.gelu, key=k1)
        self.out = eqx.nn.Linear(64, 4, key=k2)

    def __call__(self, x):  # one example; vmapped over the batch in the loss
        return self.out(self.mlp(self.norm(x)))


model = Model(jax.random.key(0))
params, static = eqx.partition(model, eqx.is_inexact_array)  # arrays / everything else
tx = optax.adam(1e-3)


def loss_fn(params, batch):
    model = eqx.combine(params, static)
    x, y = batch
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def train_step(params, opt_state, batch):
    loss, grads = autopp.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return eqx.apply_updates(params, updates), opt_state, loss


step = autopp.parallelize(train_step, num_stages=2, num_microbatches=4, schedule="1f1b",
                          devices=jax.devices()[:2])
batch = (jax.random.normal(jax.random.key(1), (32, 16)), jax.random.normal(jax.random.key(2), (32, 4)))
opt_state = tx.init(params)
print(step.plan_for(params, opt_state, batch))
for i in range(3):
    params, opt_state, loss = step(params, opt_state, batch)
    print(f"step {i}: loss {float(loss):.5f}")
model = eqx.combine(params, static)  # the trained module
