"""Fidelity of the calibrated time model on this CPU: predicted vs measured time per layer.

Every distinct layer (forward, and forward+backward) of the zoo MLP and GPT at two sizes each is compiled
and timed (best of 3 rounds of 15 calls). The kernel time model's five device constants (see
``KernelTimeModel``) are fitted (a) to all layers of all four models and (b) leaving each model out and
predicting it from the other three. Run: ``pytest benchmarks/bench_fidelity.py -s`` (goal: median <= 15%).
"""

import statistics

import jax
import optax

from autopp.core._trace import trace_step
from autopp.models import GPT, MLP, GPTConfig, MLPConfig
from autopp.profiler import group_layers
from autopp.profiler._costs import kernel_costs
from autopp.profiler._measure import measure_layer
from autopp.profiler._profile import layer_programs
from autopp.profiler._timemodel import KernelTimeModel
from benchmarks._common import train_step_fn

MODELS = {
    "mlp-s": (MLP(MLPConfig(sizes=(256, 512, 512, 512, 256))), 128),
    "mlp-l": (MLP(MLPConfig(sizes=(512, 1024, 1024, 1024, 512))), 256),
    "gpt-s": (GPT(GPTConfig(layers=2, hidden=128, heads=4, seq=64, vocab=512)), 4),
    "gpt-l": (GPT(GPTConfig(layers=2, hidden=256, heads=8, seq=128, vocab=1024)), 4),
}
ROUNDS = 3


def _layer_programs(model, batch_size):
    tx = optax.sgd(1e-3)
    params = model.init_abstract()
    batch = jax.eval_shape(lambda: model.batch(jax.random.key(0), batch_size))
    traced = trace_step(train_step_fn(model, tx), (params, jax.eval_shape(tx.init, params), batch), (2,))
    layers = group_layers(traced.spec.forward, traced.microbatched_grad_inputs, traced.spec.diff_mask)
    names = {l.fingerprint: l.name for l in reversed(layers)}
    return [(names[fp], closed, both, diff) for fp, (closed, both, diff, _) in layer_programs(traced, layers).items()]


def test_time_model_fidelity(benchmark):
    programs = {name: _layer_programs(*spec) for name, spec in MODELS.items()}
    best: dict = {}
    for _ in range(ROUNDS):  # rounds over all layers, so that a burst of load on the machine hits one round
        for model, layers in programs.items():
            for name, closed, both, diff in layers:
                m = measure_layer(closed, diff, repeats=15)
                f, fb = best.get((model, name), (float("inf"), float("inf")))
                best[(model, name)] = (min(f, m.forward_s), min(fb, m.forward_s + m.backward_s))
    samples = {}
    for model, layers in programs.items():
        samples[model] = []
        for name, closed, both, _ in layers:
            f, fb = best[(model, name)]
            samples[model].append((f"{name} fwd", kernel_costs(closed.jaxpr), f))
            samples[model].append((f"{name} fwd+bwd", kernel_costs(both.jaxpr), fb))
    everything = [(k, t) for rows in samples.values() for _, k, t in rows]
    fitted_all = benchmark.pedantic(lambda: KernelTimeModel.calibrate("cpu", everything), rounds=1, iterations=1)
    rows, in_sample, held_out = [], [], []
    for model, own in samples.items():
        loo = KernelTimeModel.calibrate("cpu", [(k, t) for m, r in samples.items() if m != model for _, k, t in r])
        for label, kernels, measured in own:
            p_all, p_loo = fitted_all.time(kernels), loo.time(kernels)
            in_sample.append(abs(p_all - measured) / measured)
            held_out.append(abs(p_loo - measured) / measured)
            rows.append(f"  {model:6s} {label:16s} measured {measured * 1e3:7.3f} ms  calibrated {p_all * 1e3:7.3f} ms "
                        f"({in_sample[-1] * 100:5.1f}%)  held-out {p_loo * 1e3:7.3f} ms ({held_out[-1] * 100:5.1f}%)")
    med_in, med_out = statistics.median(in_sample), statistics.median(held_out)
    benchmark.extra_info.update(median_error_calibrated=med_in, median_error_held_out=med_out, samples=len(rows))
    print(f"\n[fidelity] fitted constants: {fitted_all.to_dict()}")
    print("\n".join(rows))
    print(f"[fidelity] median absolute error over {len(rows)} layer programs: calibrated on all four models "
          f"{med_in * 100:.1f}%, held-out model {med_out * 100:.1f}% (goal <= 15%)")
