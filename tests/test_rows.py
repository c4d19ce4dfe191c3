"""Stacked parameters held by rows (``runtime/_rows.py``): a model written with ``lax.scan`` over stacked layers keeps
each stage's rows of the stack, their gradients and optimizer state on that stage, and equals plain jit of the same
microbatched step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autopp
from autopp.models import GPT, GPTConfig, make_train_step
from tests._helpers import ScannedGPT, assert_trees_close, microbatched_jit

CONFIG = GPTConfig(layers=8, hidden=32, heads=4, seq=16, vocab=64)


def _run(model, tx, steps, num_stages=4, num_microbatches=4, batch_size=16):
    params = model.init(jax.random.key(0))
    batch = model.batch(jax.random.key(1), batch_size)
    step = autopp.parallelize(make_train_step(model.loss, tx), num_stages=num_stages,
                              num_microbatches=num_microbatches, devices=jax.devices()[:num_stages])
    plain = microbatched_jit(model, tx, num_microbatches)
    got = want = (params, tx.init(params))
    for _ in range(steps):
        *got, _ = step(*got, batch)
        *want, _ = plain(*want, batch)
    return step, (params, tx.init(params), batch), got, want


def _sgd_steps(loss, lr=0.1):
    """An SGD step of ``loss(params, batch)``: pipelined over 4 stages and 4 microbatches, and under plain jit."""
    def make(vag):
        def step(p, batch):
            value, g = vag(loss)(p, batch)
            return jax.tree.map(lambda a, b: a - lr * b, p, g), value
        return step

    return (autopp.parallelize(make(autopp.value_and_grad), num_stages=4, num_microbatches=4,
                               devices=jax.devices()[:4]), jax.jit(make(jax.value_and_grad)))


def _stacked(tree):
    return [x for x in jax.tree.leaves(tree) if x.ndim >= 1 and x.shape[0] == CONFIG.layers]


def test_each_stage_holds_its_rows_of_the_stack():
    """SGD on the scanned GPT over 4 stages equals plain jit; every stacked parameter comes back as one array sharded
    by rows over the 4 stages' devices (2 of the 8 layers each), and no stage is sent the whole stack."""
    step, args, got, want = _run(ScannedGPT(CONFIG), optax.sgd(0.1), steps=2)
    assert_trees_close(got, want, rtol=1e-6, atol=1e-6)
    blocks = got[0]["blocks"]
    for x in jax.tree.leaves(blocks):
        assert len(x.sharding.device_set) == 4, x.sharding
        assert {s.data.shape[0] for s in x.addressable_shards} == {2}
    labels = step.executable_for(*args).describe()
    assert sum(lab.startswith("rows of args[0]['blocks']") for lab in labels) == len(jax.tree.leaves(blocks))
    stack = sum(x.nbytes for x in jax.tree.leaves(blocks))  # the plan reports each stage's rows, as it holds them
    assert [st.param_bytes >= stack // 4 for st in step.plan_for(*args).stages] == [True] * 4
    assert not [lab for lab in labels if lab.startswith("put shared parameter args[0]['blocks']")]


@pytest.mark.parametrize("name, tx", [
    ("clip+adamw", optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-3))),
    ("lamb", optax.lamb(1e-3)),
    ("adafactor", optax.adafactor(1e-2)),
    ("lion", optax.lion(1e-4)),
])
def test_optimizers_run_on_the_rows(name, tx):
    """The optimizer's state read together with a block (moments, factored second moments) is held by rows too;
    reductions over the whole stack (a global norm, LAMB's per-parameter trust ratio) are partial sums per stage.
    Three steps equal plain jit of the same microbatched step."""
    model = ScannedGPT(CONFIG)
    _, (params, opt_state, batch), got, want = _run(model, tx, steps=3)
    # Adaptive updates turn rounding noise in near-zero gradients into lr-sized steps: allow twice what plain jit
    # itself shows between the batch whole and split into the same microbatches.
    whole = (params, opt_state)
    for _ in range(3):
        *whole, _ = microbatched_jit(model, tx, 1)(*whole, batch)
    noise = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(whole)))
    assert_trees_close(got, want, rtol=0, atol=max(2 * noise, 1e-6))
    if name in ("clip+adamw", "lion"):
        state = _stacked(got[1])
        assert state and all(len(x.sharding.device_set) == 4 for x in state)


def test_the_stacks_state_is_divided_between_the_stages(monkeypatch):
    """With AdamW, against the same step with the stack kept whole (the rewrite switched off): the first stage no
    longer keeps the whole stack's parameters, moments and gradient (4 stack sizes, one stage's share of it now), and
    no device's peak (``memory_report``) grows."""
    import autopp.runtime._executor as executor

    tx = optax.adamw(1e-3)
    step, args, _, _ = _run(ScannedGPT(CONFIG), tx, steps=1)
    rows = step.executable_for(*args).memory_report()
    monkeypatch.setattr(executor, "hold_by_rows", lambda *a, **k: None)
    step, args, _, _ = _run(ScannedGPT(CONFIG), tx, steps=1)
    whole = step.executable_for(*args).memory_report()
    stack = sum(x.nbytes for x in _stacked(args[0]))
    assert all(rows[d] <= whole[d] for d in whole), (rows, whole)
    assert whole[0] - rows[0] >= 2 * stack, (rows, whole, stack)


def test_steps_that_cannot_be_held_by_rows_stay_whole():
    """Blocks of unequal length (6 layers over 4 stages: with a warning naming the stack and why) and a loss that reads
    the stack whole (a penalty on all of it) keep the stack one array, as before; both equal plain jit."""
    uneven = GPTConfig(layers=6, hidden=32, heads=4, seq=16, vocab=64)
    with pytest.warns(UserWarning, match=r"args\[0\]\['blocks'\].*stay whole.*unequal numbers of the stack's 6 rows"):
        step, args, got, want = _run(ScannedGPT(uneven), optax.sgd(0.1), steps=1)
    assert_trees_close(got, want, rtol=1e-6, atol=1e-6)
    assert not [lab for lab in step.executable_for(*args).describe() if lab.startswith("rows of")]

    class Penalized(ScannedGPT):
        def loss(self, params, batch):
            return super().loss(params, batch) + 1e-3 * jnp.sum(params["blocks"]["mlp"]["fc_w"] ** 2)

    step, args, got, want = _run(Penalized(CONFIG), optax.sgd(0.1), steps=1)
    assert_trees_close(got, want, rtol=1e-6, atol=1e-6)
    labels = step.executable_for(*args).describe()
    assert "rows of args[0]['blocks']['mlp']['fc_w']" not in labels
    assert "rows of args[0]['blocks']['mlp']['proj_w']" in labels


def test_an_update_that_reads_the_stack_whole_concatenates_the_rows():
    """An update written with a reshape and a per-layer norm over the stack (no rule acts on it by rows) reads the
    blocks concatenated: correct, on one stage."""
    def per_layer_normalized(lr):
        def update(grads, state, params=None):
            def one(g):
                if g.ndim < 3:
                    return -lr * g
                norms = jnp.linalg.norm(g.reshape(g.shape[0], -1), axis=1)
                return -lr * g / (norms[:, None, None] + 1e-6)
            return jax.tree.map(one, grads), state
        return optax.GradientTransformation(lambda p: optax.EmptyState(), update)

    _, _, got, want = _run(ScannedGPT(CONFIG), per_layer_normalized(0.05), steps=2)
    assert_trees_close(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(got[0]["wte"]).shape, (CONFIG.vocab, CONFIG.hidden))


def test_a_state_held_by_rows_checkpoints_and_resumes(tmp_path):
    """The row-sharded stack a step returns saves and restores like any array, and training resumes from it."""
    model, tx = ScannedGPT(CONFIG), optax.adamw(1e-3)
    step, (params, opt_state, batch), got, want = _run(model, tx, steps=2)
    autopp.checkpoint.save(tmp_path, 2, tuple(got))
    restored = autopp.checkpoint.restore(tmp_path, like=(params, opt_state))
    assert_trees_close(restored, tuple(got), rtol=0, atol=0)
    *resumed, _ = step(*restored, batch)
    *expected, _ = step(*got, batch)
    assert_trees_close(resumed, expected, rtol=0, atol=0)


def test_the_planner_counts_the_stack_as_the_runtime_holds_it():
    """On one node without tensor, FSDP or ZeRO-1 splits, a scanned model's predicted memory (``simulate``) is its
    Python-loop twin's: each stage its rows. Across nodes (one process per node) and under ZeRO-1 the runtime keeps the
    stack whole, and the prediction is more than the twin's."""
    from autopp.planner import simulate
    from autopp.profiler import profile

    config = GPTConfig(layers=8, hidden=256, heads=4, seq=64, vocab=256, dtype="bfloat16")
    tx = optax.adamw(1e-3)
    profiles = {}
    for name, model in (("scan", ScannedGPT(config)), ("loop", GPT(config))):
        params = jax.eval_shape(model.init, jax.random.key(0))
        profiles[name] = profile(make_train_step(model.loss, tx), params, jax.eval_shape(tx.init, params),
                                 jax.eval_shape(lambda: model.batch(jax.random.key(0), 8)), cluster="1x8xH100")

    def peak(name, cluster, **kw):
        return simulate(profiles[name], cluster, global_batch=16, tp=1, pp=4, dp=2, microbatch_size=2,
                        schedule="1f1b", recompute="none", **kw).peak_memory_bytes_per_gpu

    assert peak("scan", "1x8xH100") == pytest.approx(peak("loop", "1x8xH100"), rel=1e-6)
    assert peak("scan", "2x4xH100") > peak("loop", "2x4xH100")
    assert peak("scan", "1x8xH100", zero1=True) > peak("loop", "1x8xH100", zero1=True)


def test_a_stage_keeps_no_copy_of_its_rows_per_microbatch():
    """A stage reads its block whole, so its rolled-back scan takes the block as it is, and JAX keeps the block itself
    (an input) for the backward: no forward of a block stage outputs a copy of its rows per microbatch."""
    step, args, _, _ = _run(ScannedGPT(CONFIG), optax.sgd(0.1), steps=1)
    exe = step.executable_for(*args)
    blocks = {(x.shape[0] // 4,) + x.shape[1:] for x in jax.tree.leaves(args[0]["blocks"]) if x.ndim >= 3}
    forwards = [t for t in exe.tasks if t.label in ("1F0", "2F0")]
    assert len(forwards) == 2
    for t in forwards:
        outs = {tuple(exe.slot_avals[s].shape) for s in t.outs}
        assert not outs & blocks, (t.label, outs & blocks)


def test_a_reversed_scan_is_held_by_rows_and_an_interleaved_schedule_says_why_not():
    """``lax.scan(..., reverse=True)``: the last stage reads the first rows; the blocks are held by rows all the same
    (the row-sharded array lists the stages' devices in row order). Two model chunks per device group (interleaved
    1F1B) cannot hold a stack as one row-sharded array: a warning names the stack and the schedule. Both equal jit."""
    class Reversed(ScannedGPT):
        def apply(self, params, tokens):
            x = self.embed(params, tokens)
            x, _ = jax.lax.scan(lambda h, bp: (self.block(bp, h), None), x, params["blocks"], reverse=True)
            return self.head(params, x)

    step, args, got, want = _run(Reversed(CONFIG), optax.sgd(0.1), steps=2)
    assert_trees_close(got, want, rtol=1e-6, atol=1e-6)
    w = got[0]["blocks"]["mlp"]["fc_w"]
    assert len(w.sharding.device_set) == 4
    rows_on = {s.device.id: s.index[0].start for s in w.addressable_shards}
    assert rows_on[3] == 0 and rows_on[0] == 6, rows_on  # the last stage runs the first rows

    params = ScannedGPT(CONFIG).init(jax.random.key(0))
    tx = optax.sgd(0.1)
    interleaved = autopp.parallelize(make_train_step(ScannedGPT(CONFIG).loss, tx), num_stages=2, num_microbatches=4,
                                     schedule="interleaved-1f1b", virtual_stages=2, devices=jax.devices()[:2])
    with pytest.warns(UserWarning, match=r"stay whole.*share devices \(interleaved-1f1b"):
        *got, _ = interleaved(params, tx.init(params), ScannedGPT(CONFIG).batch(jax.random.key(1), 16))
    *want, _ = microbatched_jit(ScannedGPT(CONFIG), tx, 4)(params, tx.init(params),
                                                           ScannedGPT(CONFIG).batch(jax.random.key(1), 16))
    assert_trees_close(got, want, rtol=1e-6, atol=1e-6)


def test_two_stacks_on_different_stages_are_each_held_by_rows():
    """An encoder stack and a decoder stack (two scans, 4 layers each) over 4 stages: each stack is divided over the
    stages that run its iterations, two rows each; SGD equals plain jit."""
    hidden, layers = 16, 4
    k = jax.random.split(jax.random.key(0), 3)
    params = {"enc": jax.random.normal(k[0], (layers, hidden, hidden)) * 0.3,
              "dec": jax.random.normal(k[1], (layers, hidden, hidden)) * 0.3,
              "head": jax.random.normal(k[2], (hidden, 1)) * 0.3}
    x = jax.random.normal(jax.random.key(1), (16, hidden))
    y = jax.random.normal(jax.random.key(2), (16, 1))

    def loss(p, batch):
        h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), batch[0], p["enc"])
        h, _ = jax.lax.scan(lambda h, w: (h + jnp.tanh(h @ w), None), h, p["dec"])
        return jnp.mean((h @ p["head"] - batch[1]) ** 2)

    pipelined, plain = _sgd_steps(loss)
    got = want = params
    for _ in range(2):
        got, _ = pipelined(got, (x, y))
        want, _ = plain(want, (x, y))
    assert_trees_close(got, want, rtol=1e-6, atol=1e-6)
    for name in ("enc", "dec"):
        assert len(got[name].sharding.device_set) == 2, (name, got[name].sharding)
    assert got["enc"].sharding.device_set.isdisjoint(got["dec"].sharding.device_set)


def test_a_cut_inside_an_iteration_loses_ties_to_an_iteration_boundary(recwarn):
    """A block written ``(x + mlp) + b``: the cut before ``+ b`` moves as few bytes as the cut between iterations. The
    split takes the boundary, so every stacked leaf (``b`` included) is held by rows and nothing warns."""
    hidden, layers = 16, 8
    k = jax.random.split(jax.random.key(0), 5)
    params = {"embed": jax.random.normal(k[0], (8, hidden)) * 0.3, "head": jax.random.normal(k[1], (hidden, 2)) * 0.3,
              "blocks": {"w1": jax.random.normal(k[2], (layers, hidden, 2 * hidden)) * 0.2,
                         "w2": jax.random.normal(k[3], (layers, 2 * hidden, hidden)) * 0.2,
                         "b": jax.random.normal(k[4], (layers, hidden)) * 0.1}}
    batch = (jax.random.normal(jax.random.key(1), (16, 8)), jax.random.normal(jax.random.key(2), (16, 2)))

    def loss(p, b):
        def block(x, q):
            return (x + jnp.tanh(x @ q["w1"]) @ q["w2"]) + q["b"], None
        h, _ = jax.lax.scan(block, b[0] @ p["embed"], p["blocks"])
        return jnp.mean((h @ p["head"] - b[1]) ** 2)

    pipelined, plain = _sgd_steps(loss)
    got, _ = pipelined(params, batch)
    want, _ = plain(params, batch)
    assert_trees_close(got, want, rtol=1e-6, atol=1e-6)
    assert not [w for w in recwarn if "stay whole" in str(w.message)]
    assert all(len(x.sharding.device_set) == 4 for x in jax.tree.leaves(got["blocks"]))


def test_whole_stacks_on_the_host_are_read_into_rows_without_compiling():
    """A stacked input given whole (the first step's, from ``init``) is split into its stages' blocks. On the CPU
    backend the split is made on the host: JAX's on-device split would compile a slicing program per leaf shape
    (about a quarter second each on two cores), which the first call of a scanned model paid for every stacked leaf."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from autopp.runtime._rows import block_reader, row_sharding

    blocks = [NamedSharding(Mesh(np.array([d]), ("data",)), PartitionSpec()) for d in jax.devices()[:4]]
    read = block_reader(row_sharding(blocks), blocks)
    stack = jax.random.normal(jax.random.key(3), (8, 5, 7))  # a shape nothing else here has
    compiles = []

    def listener(event, duration, **kw):
        if "compile" in event:
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        got = jax.block_until_ready(read(stack))
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert compiles == []
    for k, (block, sharding) in enumerate(zip(got, blocks)):
        assert block.sharding == sharding
        np.testing.assert_array_equal(block, stack[2 * k:2 * k + 2])


def test_a_stage_boundary_inside_an_iteration_is_named_as_the_reason():
    """A split that cuts inside an iteration (here stage 1 starts in the middle of iteration 3 of 8: stage 0 reads
    ``w1``'s rows 0-3 and ``w2``'s 0-2) keeps ``w2`` whole (``w1`` splits 4 + 4), and the reason names the iteration
    that the boundary falls inside and its stages, not only the rows' unequal counts (a user trial's 4 layers on 4
    stages were told that a stage count dividing the rows would do)."""
    from autopp.core import row_slice, trace_microbatch_forward, trace_step
    from autopp.profiler import split_at
    from autopp.runtime._rows import hold_by_rows

    hidden, layers = 8, 8
    params = {"w1": jnp.ones((layers, hidden, hidden)) * 0.1, "w2": jnp.ones((layers, hidden, hidden)) * 0.1}
    batch = jnp.ones((8, hidden))

    def loss(p, x):
        def block(h, q):
            return jnp.tanh(jnp.tanh(h @ q["w1"]) @ q["w2"]), None
        return jnp.mean(jax.lax.scan(block, x, p)[0] ** 2)

    def step(p, x):
        return autopp.grad(loss)(p, x)

    traced = trace_step(step, (params, batch), (1,))
    forward = trace_microbatch_forward(step, (params, batch), traced, 2)
    eqns = forward.jaxpr.eqns
    assert sum(row_slice(e) is not None for e in eqns) == 2 * layers  # each iteration reads a row of each stack
    x = forward.jaxpr.invars[-1]
    first = min(i for i, e in enumerate(eqns) if x in e.invars)
    dots = [i for i, e in enumerate(eqns) if e.primitive.name == "dot_general"]
    inside = dots[2 * 3 + 1]  # stage 1 starts at iteration 3's second matmul, the one that reads w2's row
    split = split_at(forward, traced.microbatched_grad_inputs, [first, inside])
    report: list = []
    hold_by_rows(traced, forward, split.stage_eqns, lambda stages: None, report=report)
    reasons = dict(report)
    assert set(reasons) == {"args[0]['w2']"}, reasons
    assert "8 rows ([3, 5]; the stage split puts a boundary inside iteration 3, whose parameters are read on stages " \
           "[0, 1])" in reasons["args[0]['w2']"]


def test_unequal_row_counts_are_named_by_the_plan_s_stages():
    """A 2-stage plan whose stages are cut into 3 segments used to say "the stages read unequal numbers ... ([2, 1,
    3])", three counts for two stages (a user trial); the counts are now the stages', with the segments' beside."""
    from autopp.runtime._rows import _unequal

    reads = [(i, row, seg) for i, (row, seg) in enumerate([(0, 0), (1, 0), (2, 1), (3, 2), (4, 2), (5, 2)])]
    message = _unequal(reads, 6, {(6, r): {s} for _, r, s in reads}, plan_stage=(0, 0, 1))
    assert "([3, 3] by stage, [2, 1, 3] by the segments" in message
    assert "([2, 1, 3])" in _unequal(reads, 6, {(6, r): {s} for _, r, s in reads})  # no plan: the stages given


def test_noise_drawn_in_the_step_with_the_batch_s_shape_is_split_beside_the_rows():
    """A scanned DiT trial drawing its diffusion noise in the step (``normal(key, x.shape)``: it grows with the batch
    though no data flows into it) was refused, naming parameters as split into microbatches, whenever its stack was
    held by rows: the positions of the values that grow with the batch pointed at the loss's inputs before the
    stack became one input per block. Equal to jit (SGD)."""
    w = jax.random.normal(jax.random.key(0), (4, 8, 8)) * 0.3
    params = {"stack": w, "head": jnp.ones((8,))}

    def loss(p, x, noise):
        h = jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), x + noise, p["stack"])[0]
        return ((h @ p["head"]) ** 2).mean()

    def make(vag):
        def step(p, x):
            noise = jax.random.normal(jax.random.key(5), x.shape) * 0.1
            value, g = vag(loss)(p, x, noise)
            return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), value
        return step

    x = jax.random.normal(jax.random.key(1), (16, 8))
    pipelined = autopp.parallelize(make(autopp.value_and_grad), num_stages=2, num_microbatches=4,
                                   devices=jax.devices()[:2])
    got = pipelined(params, x)
    assert {s.data.shape[0] for s in got[0]["stack"].addressable_shards} == {2}  # held by rows
    assert_trees_close(got, jax.jit(make(jax.value_and_grad))(params, x), rtol=1e-6, atol=1e-6)


def test_a_vector_of_per_task_values_is_no_stack_of_layers():
    """A vector of per-task log-variances read as ``s[t]`` twice per task in a Python loop (user trial MULTITASK) got
    the warning that "the stacked parameter(s) stay whole ... unequal numbers of the stack's 3 rows ([2, 4])": no
    scan reads it, and rows read more than once are no stack of layers. It stays whole without a word; the step equals
    plain jit (SGD, <= 1e-6)."""
    import warnings

    keys = jax.random.split(jax.random.key(0), 3)
    params = {"w": jax.random.normal(keys[0], (8, 3)) * 0.3, "s": jnp.array([0.1, -0.2, 0.3])}
    batch = {"x": jax.random.normal(keys[1], (16, 8)), "y": jax.random.normal(keys[2], (16, 3))}
    tx = optax.sgd(0.1)

    def loss(p, b):
        per_task = lambda t: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2, 0)[t]  # noqa: E731
        return sum(jnp.exp(-p["s"][t]) * per_task(t) + p["s"][t] for t in range(3))

    step = make_train_step(loss, tx)
    want = jax.jit(step)(params, tx.init(params), batch)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = autopp.parallelize(step, num_stages=2, num_microbatches=4, devices=jax.devices()[:2])(
            params, tx.init(params), batch)
    assert not [str(w.message) for w in seen if "autopp" in str(w.message)]
    assert_trees_close(autopp.gather(got), want, rtol=1e-6, atol=1e-6)
