"""Metrics while training: the log line's fields against hand-computed values."""

import jax
import pytest

from autopp import _metrics
from autopp.metrics import MetricsLogger, StepMetrics, log_metrics, tokens_in
from tests._spmd_cases import CONFIG, jit_case  # test_baselines' step: its jax.jit is compiled once


@pytest.fixture(scope="module")
def case():
    step, state, batch = jit_case(CONFIG, 8)
    return step, jax.jit(step), state, batch


class _Clock:
    """perf_counter stand-in: each call advances by the next of ``steps`` seconds."""

    def __init__(self, steps):
        self.now, self.steps = 100.0, iter(steps)

    def __call__(self):
        self.now += next(self.steps)
        return self.now


def test_the_line_has_hand_computed_fields(case, monkeypatch):
    step, jitted, state, batch = case
    flops = CONFIG.flops_per_step(8)  # Narayanan et al.'s count, independent of autopp's profiler

    class WithMemory:  # a step that knows its peak memory, as autopp and baseline steps do
        devices = jax.devices()[:2]

        def __call__(self, *args):
            return jitted(*args)

        def peak_memory_bytes(self, *args):
            return 3 * 2**20

    lines = []
    # Clock reads: step 1's start, its end, the end of its bookkeeping (not counted); step 2's end, bookkeeping.
    monkeypatch.setattr(_metrics.time, "perf_counter", _Clock([0.0, 0.04, 0.5, 0.05, 0.5]))
    logger = MetricsLogger(WithMemory(), sink=lines.append, flops_per_step=flops, peak_flops=1e12)
    st = state
    for _ in range(2):
        *st, loss = logger(*st, batch)
    m = logger.history[-1]
    assert m.step == 2 and m.loss == pytest.approx(float(loss))
    assert m.step_time_s == pytest.approx(0.05)
    assert m.tokens_per_s == pytest.approx(8 * 16 / 0.05)  # batch x seq / step time
    assert m.tflops_per_device == pytest.approx(flops / 0.05 / 2 / 1e12)
    assert m.mfu == pytest.approx(flops / (0.05 * 2 * 1e12))
    assert m.peak_memory_bytes == 3 * 2**20
    assert lines[-1] == (f"step 2 | loss {float(loss):.4f} | 50.0 ms | 2.6k tok/s | "
                         f"{flops / 0.05 / 2 / 1e12:.3g} TFLOP/s/dev | mfu {m.mfu * 100:.1f}% | mem 3.0 MiB")


def test_defaults_count_flops_and_tokens_and_show_no_mfu_on_cpu(case):
    step, jitted, state, batch = case
    assert jitted.__wrapped__ is step  # the FLOPs come from profiling the step function jax.jit wraps
    lines = []
    logger = log_metrics(jitted, sink=lines.append, every=2)
    st = state
    for _ in range(4):
        *st, _ = logger(*st, batch)
    assert [m.step for m in logger.history] == [2, 4] and len(lines) == 2
    m = logger.history[-1]
    xla = jax.jit(step).lower(*state, batch).cost_analysis()["flops"]  # XLA's own count of the step
    assert logger.devices == [jax.devices()[0]]  # the devices holding its outputs: per device of those
    flops = m.tflops_per_device * m.step_time_s * len(logger.devices) * 1e12
    assert flops == pytest.approx(xla, rel=0.05)
    assert m.tokens_per_s * m.step_time_s == pytest.approx(tokens_in(batch)) and tokens_in(batch) == 8 * 16
    assert m.mfu is None and "| mfu - |" in lines[-1]  # the CPU's peak is not known
    assert m.peak_memory_bytes is None and lines[-1].endswith("mem -")  # a plain jit step on CPU


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="every must be a positive int"):
        MetricsLogger(lambda *a: a, every=0)
    with pytest.raises(TypeError, match="expected a callable"):
        MetricsLogger(3)
    assert StepMetrics(1, 2.0, 0.5, 10.0, None, None, None).line() == \
        "step 1 | loss 2.0000 | 500.0 ms | 10.0 tok/s | - TFLOP/s/dev | mfu - | mem -"


def test_a_plain_jax_step_gets_xlas_flop_count_or_none(case):
    """A step written with jax.value_and_grad (which autopp's profiler cannot read): a jax.jit one gets XLA's own
    count; any other callable logs without TFLOP/s (one warning), instead of failing after its step ran."""
    import optax

    from autopp.models import GPT

    _, _, (params, _), batch = case
    model, tx = GPT(CONFIG), optax.sgd(0.1)

    def plain(params, opt_state, batch):
        loss, grads = jax.value_and_grad(model.loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    jitted = jax.jit(plain)
    state = (params, tx.init(params))
    logger = log_metrics(jitted, sink=None)
    logger(*state, batch)
    assert logger.flops_per_step == jitted.lower(*state, batch).cost_analysis()["flops"] > 0
    # per device of the one device it ran on (a user trial: divided by all 8, 8x too low)
    m = logger.history[-1]
    assert logger.devices == [jax.devices()[0]]
    assert m.tflops_per_device == pytest.approx(logger.flops_per_step / m.step_time_s / 1e12)
    lines = []
    opaque = log_metrics(lambda *a: jitted(*a), sink=lines.append)
    with pytest.warns(UserWarning, match="TFLOP/s and MFU are left out. Pass flops_per_step="):
        opaque(*state, batch)
    opaque(*state, batch)  # counted once: no second warning, no error
    assert opaque.history[-1].tflops_per_device is None and "| - TFLOP/s/dev |" in lines[-1]


def test_a_leaf_named_loss_is_the_loss():
    """A step returning ``{"loss": ..., "lr": ...}``: the loss is the leaf named ``loss``, not the last flat leaf
    (``lr``, the last in sorted keys, used to be logged as the loss); without such a leaf, the last one."""
    import jax.numpy as jnp

    lines = []
    named = log_metrics(lambda x: {"loss": jnp.sum(x), "lr": jnp.float32(0.1)}, sink=lines.append,
                        flops_per_step=1.0, tokens_per_step=1)
    named(jnp.arange(4.0))
    assert named.history[-1].loss == 6.0
    plain = log_metrics(lambda x: (x, jnp.sum(x)), sink=lines.append, flops_per_step=1.0, tokens_per_step=1)
    plain(jnp.arange(4.0))
    assert plain.history[-1].loss == 6.0
    chosen = log_metrics(lambda x: {"loss": jnp.sum(x), "lr": jnp.float32(0.1)}, sink=lines.append,
                         flops_per_step=1.0, tokens_per_step=1, loss_index=1)
    chosen(jnp.arange(4.0))
    assert chosen.history[-1].loss == pytest.approx(0.1)
