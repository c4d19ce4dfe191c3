"""Scan over layers (as in MaxText and Levanter): L identical blocks whose parameters are stacked on a leading
axis and applied with jax.lax.scan, trained as a 3-stage pipeline. No stage markers: autopp splits the scan
across stages by iteration range (here 6 iterations over 3 stages), and the stacked parameters' gradient is
the sum of the stages' contributions.

    python examples/scan_layers.py
"""

import jax

jax.config.update("jax_num_cpu_devices", 8)  # 8 fake devices on a CPU-only machine

import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import autopp  # noqa: E402

LAYERS, HIDDEN = 6, 64


def init(key):
    k = jax.random.split(key, 4)
    scale = HIDDEN ** -0.5
    return {
        "embed": jax.random.normal(k[0], (16, HIDDEN)) * 0.25,
        "blocks": {  # one leaf per block parameter, stacked: leading dimension LAYERS
            "w1": jax.random.normal(k[1], (LAYERS, HIDDEN, 4 * HIDDEN)) * scale,
            "w2": jax.random.normal(k[2], (LAYERS, 4 * HIDDEN, HIDDEN)) * scale / 2,
            "scale": jnp.ones((LAYERS, HIDDEN)),
        },
        "head": jax.random.normal(k[3], (HIDDEN, 4)) * scale,
    }


def block(x, p):
    y = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * p["scale"]  # RMSNorm
    return x + jax.nn.gelu(y @ p["w1"]) @ p["w2"], None


def loss_fn(params, batch):
    x, y = batch
    h, _ = jax.lax.scan(block, x @ params["embed"], params["blocks"])
    return jnp.mean((h @ params["head"] - y) ** 2)


tx = optax.adam(1e-3)


def train_step(params, opt_state, batch):
    loss, grads = autopp.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


step = autopp.parallelize(train_step, num_stages=3, num_microbatches=6, schedule="1f1b",
                          devices=jax.devices()[:3])
params = init(jax.random.key(0))
batch = (jax.random.normal(jax.random.key(1), (48, 16)), jax.random.normal(jax.random.key(2), (48, 4)))
opt_state = tx.init(params)
print(step.plan_for(params, opt_state, batch))
for i in range(3):
    params, opt_state, loss = step(params, opt_state, batch)
    print(f"step {i}: loss {float(loss):.5f}")
