"""Trace a training step to a flat jaxpr with one gradient equation (the first of autopp's four phases)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core as jex_core

from autopp.core import _compat
from autopp.core._grad import GradSpec, marking_gradients, value_and_grad_p
from autopp.core._batch_reads import refuse_batch_positions, refuse_reads_past_rows
from autopp.core._constraints import drop_sharding_constraints
from autopp.core._jaxpr import eqn_signature, eval_jaxpr_with, leaked_tracers, sink_parameter_work
from autopp.core._batch_split import refuse_leaves_without_rows, sparse_batch_leaves, sparse_refusal
from autopp.core._warn import concrete_value_error
from autopp.core._zero_grads import freeze_zero_gradients
from autopp.core._hoist import hoist_batch_independent_work, hoisted_like


@dataclasses.dataclass(frozen=True)
class TracedStep:
    """A training step as one flat jaxpr whose single ``autopp_value_and_grad`` equation is the loss."""

    jaxpr: jex_core.ClosedJaxpr
    """The whole step; calls (``jit``) inlined, so the gradient equation is at top level."""
    in_tree: Any
    """Tree of the positional arguments (a tuple)."""
    out_tree: Any
    """Tree of the step's result."""
    grad_index: int
    """Index of the gradient equation in ``jaxpr.jaxpr.eqns``."""
    batch_mask: tuple[bool, ...]
    """Per flat input: whether it belongs to a batch argument (split into microbatches)."""
    leaf_paths: tuple[str, ...]
    """Per flat input: its pytree path, for error messages (e.g. ``args[2]['tokens']``)."""
    batch_argnums: tuple[int, ...]
    """The positional arguments that hold the batch."""
    shape_batched: tuple[int, ...] = ()
    """Positions of the gradient equation's inputs that the step computes from the batch's shape alone (position ids
    ``broadcast_to(arange(T), (B, T))``, per-example keys ``random.split(key, B)``): no data flows from the batch into
    them, but their leading dimension grows with it (found by tracing the step again at twice the batch). They are
    microbatched like the batch itself: computed for the whole batch, each microbatch reads its rows, as under
    ``jax.jit``."""
    whole_batch_arrays: tuple[int, ...] = ()
    """Positions of the gradient equation's inputs that the step computes from the batch's data but that do not grow
    with it (a batch statistic; a discriminator updated by a gradient over the batch before the generator's loss
    reads it), found by the same second trace: they are not microbatched; every microbatch reads the step's value,
    as under ``jax.jit``."""
    zeroed_gradients: tuple[tuple[Any, int], ...] = ()
    """Weights the loss differentiates in the user's code whose gradient is zero (``stop_gradient``) or read by
    nothing (``optax.set_to_zero``), made frozen weights (:mod:`autopp.core._zero_grads`): pairs of the variable
    holding the zeros the step reads in place of one's gradient and its position among the gradient equation's
    inputs."""

    @property
    def grad_eqn(self) -> jex_core.JaxprEqn:
        return self.jaxpr.jaxpr.eqns[self.grad_index]

    @property
    def spec(self) -> GradSpec:
        return self.grad_eqn.params["spec"]

    @functools.cached_property
    def _batch_derived_grad_inputs(self) -> tuple[bool, ...]:
        jaxpr = self.jaxpr.jaxpr
        dep = {v for v, b in zip(jaxpr.invars, self.batch_mask) if b}
        for i, e in enumerate(jaxpr.eqns):
            if i != self.grad_index and any(not isinstance(a, jex_core.Literal) and a in dep for a in e.invars):
                dep.update(e.outvars)
        return tuple((not isinstance(a, jex_core.Literal) and a in dep) or k in self.shape_batched
                     for k, a in enumerate(self.grad_eqn.invars))

    @functools.cached_property
    def microbatched_grad_inputs(self) -> tuple[bool, ...]:
        """Per input of the gradient equation: whether it derives from a batch argument and is split with it (is
        microbatched). A scalar the step derives from the whole batch (a token count that normalises the loss) is
        not: every microbatch reads it whole (see :attr:`whole_batch_grad_inputs`)."""
        return tuple(d and bool(getattr(a.aval, "shape", ())) and k not in self.whole_batch_arrays
                     for k, (a, d) in enumerate(zip(self.grad_eqn.invars, self._batch_derived_grad_inputs)))

    @functools.cached_property
    def frozen_grad_inputs(self) -> tuple[bool, ...]:
        """Per input of the gradient equation: whether it is a frozen weight, an array the loss reads that is neither
        differentiated nor split with the batch (a LoRA base, a teacher, a probe's body). Stages hold it like a
        parameter, without gradient or optimizer state, and a tensor axis splits it as one."""
        trained = self.spec.returned_mask or self.spec.diff_mask  # (a weight only hoisted work reads is trained)
        return tuple(not d and not mb and not t and bool(getattr(a.aval, "shape", ())) for a, d, mb, t in zip(
            self.grad_eqn.invars, self.spec.diff_mask, self.microbatched_grad_inputs, (*trained, *self.spec.diff_mask[
                len(trained):])))

    @functools.cached_property
    def whole_batch_grad_inputs(self) -> tuple[int, ...]:
        """Positions of the gradient equation's inputs that the step derives from the whole batch, not split with it
        (``n = mask.sum()`` passed to the loss, a count per task): each microbatch's loss reads the step's value, so
        microbatch losses add up to the step's loss only with ``loss_reduction="sum"``."""
        return tuple(k for k, (a, d) in enumerate(zip(self.grad_eqn.invars, self._batch_derived_grad_inputs))
                     if d and (not getattr(a.aval, "shape", ()) or k in self.whole_batch_arrays))

    @functools.cached_property
    def fingerprint(self) -> str:
        """A stable hash of the traced computation: the step's and the loss's operations and types."""
        return self._hash(literal_values=True)

    @functools.cached_property
    def plan_fingerprint(self) -> str:
        """:attr:`fingerprint` without the values of literals: what a plan is made for. A learning rate, a dropout
        rate or Adam's eps changes no operation, shape or dtype, so a plan replays after such a change."""
        return self._hash(literal_values=False)

    def _hash(self, literal_values: bool) -> str:
        h = hashlib.sha256()
        for jaxpr in (self.jaxpr.jaxpr, self.spec.forward.jaxpr):
            parts = [repr([(tuple(v.aval.shape), str(v.aval.dtype)) for v in jaxpr.invars])]
            parts += [e.primitive.name if e.primitive is value_and_grad_p else eqn_signature(e, literal_values)
                      for e in jaxpr.eqns]
            h.update("\n".join(parts).encode())
        return h.hexdigest()[:16]


def _grad_call_name(spec) -> str:
    """``autopp.value_and_grad(dloss)``: the marker and the loss function it differentiates, as the user wrote them."""
    name = getattr(spec, "fn_name", None)
    return f"{spec.name}({name})" if name and name != "<lambda>" else spec.name


def _inline_calls(closed: jex_core.ClosedJaxpr) -> jex_core.ClosedJaxpr:
    """Inline nested plain calls (``jit``) so that the gradient equation sits at top level."""
    if not any(_compat.call_body(e) is not None for e in closed.jaxpr.eqns):
        return closed

    def interpret(*args):
        return _eval_inlining(closed.jaxpr, closed.consts, args)

    return jax.make_jaxpr(interpret)(*[jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in closed.jaxpr.invars])


def _eval_inlining(jaxpr, consts, args):
    def inline(_, eqn, invals):
        body = _compat.call_body(eqn)
        return None if body is None else _eval_inlining(body.jaxpr, body.consts, invals)

    return eval_jaxpr_with(jaxpr, consts, args, inline)


def _contains_grad(jaxpr) -> bool:
    for eqn in jaxpr.eqns:
        if eqn.primitive is value_and_grad_p:
            return True
        for sub in jex_core.jaxprs_in_params(eqn.params):
            if _contains_grad(sub):
                return True
    return False


def _path_str(path) -> str:
    return "".join(str(k) for k in path)


def normalize_batch_argnums(batch_argnums, num_args: int, who: str = "autopp.parallelize") -> tuple[int, ...]:
    if num_args == 0:
        raise ValueError(f"{who}: the step was called with no positional arguments; pass the batch positionally.")
    if batch_argnums is None:
        return (num_args - 1,)
    nums = (batch_argnums,) if isinstance(batch_argnums, int) else tuple(batch_argnums)
    for a in nums:
        if not isinstance(a, int) or isinstance(a, bool):
            raise TypeError(f"batch_argnums must be an int or a tuple of ints, got {batch_argnums!r}.")
        if not -num_args <= a < num_args:
            raise ValueError(
                f"batch_argnums={batch_argnums!r} refers to argument {a}, but the step was called with "
                f"{num_args} positional argument(s); use an index in [0, {num_args})."
            )
    return tuple(sorted({a % num_args for a in nums}))


_ARRAY_LEAF_TYPES = (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct, bool, int, float, complex)


def check_array_leaves(args: Sequence[Any], who: str = "autopp.parallelize") -> None:
    """Every leaf of the step's arguments must be an array or a number, as for ``jax.jit``.

    Module pytrees (Equinox) may hold functions or other static values as leaves; the step then takes the
    array part (``eqx.partition(model, eqx.is_inexact_array)``) and closes over the rest.
    """
    flat_with_paths, _ = jax.tree_util.tree_flatten_with_path(tuple(args))
    bad = [f"  args[{p[0].idx}]{_path_str(p[1:])}: {type(leaf).__name__} {leaf!r:.60}"
           for p, leaf in flat_with_paths if not isinstance(leaf, _ARRAY_LEAF_TYPES)]
    if bad:
        if len(bad) > 8:
            bad = bad[:8] + [f"  ... and {len(bad) - 8} more"]
        raise TypeError(
            f"{who}: every leaf of the step's arguments must be an array or a number (as for "
            "jax.jit); these are not:\n" + "\n".join(bad) + "\nPass only the arrays and close over the rest: "
            "for an Equinox module, `params, static = eqx.partition(model, eqx.is_inexact_array)`, give the step "
            "`params` and rebuild the module inside the loss with `eqx.combine(params, static)`; for a Flax NNX "
            "module holding non-array variables (a name, a config), split the arrays off with a filter, `graphdef, "
            "params, rest = nnx.split(model, nnx.Param, ...)`, give the step `params` and close over the rest: "
            "`nnx.merge(graphdef, params, rest)` in the loss."
        )


def is_weak(x) -> bool:
    """Whether JAX treats ``x`` as weakly typed, as ``jax.jit`` does: a Python int, float or complex, or an array
    made from one (``jnp.asarray(0.1)``). A weak argument takes the other operand's dtype (``bf16_param - lr * g``
    stays bfloat16)."""
    return bool(getattr(x, "weak_type", False)) or (isinstance(x, (int, float, complex)) and not isinstance(x, bool))


def abstract_leaf(x, **kwargs) -> jax.ShapeDtypeStruct:
    """``x``'s type as ``jax.jit`` traces it (shape, dtype, weak type); ``kwargs`` go to ``ShapeDtypeStruct``
    (``shape=`` replaces the shape)."""
    if isinstance(x, jax.ShapeDtypeStruct) and not kwargs:
        return x
    shape = kwargs.pop("shape", np.shape(x))
    return jax.ShapeDtypeStruct(shape, jax.numpy.result_type(x), weak_type=is_weak(x), **kwargs)


@contextlib.contextmanager
def _tracing():
    """How autopp traces user code: the gradient marked, fused attention marked, jit calls inlined, scans unrolled
    (each body traced once and replayed per iteration), under the user's context mesh if the step was called in one
    (:func:`outside_the_context_mesh`: its bare ``PartitionSpec`` constraints need it, and are then dropped)."""
    mesh = getattr(_set_aside, "mesh", None)
    with (jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()), marking_gradients(), \
            _compat.marking_fused_attention(), _compat.replaying_scans(steps=True), jax.disable_jit():
        yield


_set_aside = threading.local()


@contextlib.contextmanager
def outside_the_context_mesh(who: str = "autopp.parallelize"):
    """Run a step called under ``jax.set_mesh(mesh)`` without it, except while its code is traced: every stage runs on
    its own sub-mesh, and JAX refuses programs on other devices while a context mesh is set (a user trial: a raw
    device-mismatch error from the runtime). A mesh with explicit axes types the step's values with it: refused,
    with the fix."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        yield
        return
    explicit = [n for n, t in zip(mesh.axis_names, mesh.axis_types) if t == jax.sharding.AxisType.Explicit]
    if explicit:
        raise ValueError(
            f"{who}: the step is called under jax.set_mesh with explicit axes {explicit} (mesh axes "
            f"{dict(zip(mesh.axis_names, mesh.axis_sizes))}); explicit sharding types every value with that mesh, but "
            "autopp runs each pipeline stage on its own sub-mesh of the devices it is given. Call the step outside the "
            "`with jax.set_mesh(...)` block (or set the axes to AxisType.Auto), and leave the split to autopp: "
            "devices=, and layout= for tensor or FSDP.")
    before, _set_aside.mesh = getattr(_set_aside, "mesh", None), jax.sharding.get_mesh()
    try:
        with jax.set_mesh(None):
            yield
    finally:
        _set_aside.mesh = before


def _refuse_leaked_values(closed: jex_core.ClosedJaxpr, who: str) -> None:
    if leaked_tracers(closed):
        raise ValueError(
            f"{who}: a value computed inside a lax.scan body escaped the body (appended to a Python list, stored on an "
            "object or in a global) and was used after the scan, which jax.jit refuses too (UnexpectedTracerError). "
            "A scan body hands values out only through its carry and its per-iteration outputs: return the value as "
            "part of the body's output (`return carry, (y, aux)`, then use the stacked aux after the scan) or add "
            "it to the carry.")


def trace_step(step_fn: Callable, args: Sequence[Any], batch_argnums: tuple[int, ...],
               who: str = "autopp.parallelize", *, probe_shapes: bool = True) -> TracedStep:
    """Trace ``step_fn(*args)`` (arrays or ``ShapeDtypeStruct``s) with autopp's gradient marker. ``who``: the entry
    point, named in error messages (``autopp.parallelize``, ``autopp.profiler.profile``, ...). ``probe_shapes``: find
    :attr:`TracedStep.shape_batched` (traces the step a second time when a loss input may be one)."""
    args = tuple(args)
    check_array_leaves(args, who)
    flat_with_paths, in_tree = jax.tree_util.tree_flatten_with_path(args)
    leaf_paths = tuple(f"args[{p[0].idx}]" + _path_str(p[1:]) for p, _ in flat_with_paths)
    batch_mask = tuple(p[0].idx in batch_argnums for p, _ in flat_with_paths)
    refuse_leaves_without_rows(args, flat_with_paths, batch_mask, leaf_paths, batch_argnums, who)
    abstract = [abstract_leaf(x) for _, x in flat_with_paths]

    def flat_step(*leaves):
        out = step_fn(*jax.tree_util.tree_unflatten(in_tree, list(leaves)))
        flat_out, out_tree = jax.tree_util.tree_flatten(out)
        flat_step.out_tree = out_tree
        return flat_out

    with _tracing():
        try:
            closed = jax.make_jaxpr(flat_step)(*abstract)
        except jax.errors.ConcretizationTypeError as e:
            raise concrete_value_error(e, step_fn, leaf_paths, who) from e
    _refuse_leaked_values(closed, who)
    out_tree = flat_step.out_tree
    closed = drop_sharding_constraints(_inline_calls(closed), who)
    grads = [i for i, e in enumerate(closed.jaxpr.eqns) if e.primitive is value_and_grad_p]
    if not grads:
        nested = any(
            _contains_grad(sub) for e in closed.jaxpr.eqns for sub in jex_core.jaxprs_in_params(e.params)
        )
        if nested:
            raise ValueError(
                f"{who}: autopp.grad / autopp.value_and_grad is called inside a control-flow "
                "construct (lax.scan, lax.cond, vmap, ...) of the step; call it once, at the top level of the step. "
                "A loop summing gradients over microbatches is what autopp does (drop it, pass the whole batch); a "
                "loop of optimizer steps (PPO's minibatches) is several steps: call the parallel one per minibatch.")
        raise ValueError(
            f"{who}: the step takes no gradient with autopp.grad or autopp.value_and_grad, so "
            "there is nothing to pipeline. Replace jax.grad / jax.value_and_grad in the step with "
            "autopp.grad / autopp.value_and_grad (same arguments). A function without a gradient (an evaluation "
            "loss) is not pipelined: run it with jax.jit on the state gathered onto one device "
            "(autopp.gather(params))."
        )
    if len(grads) > 1:
        raise ValueError(
            f"{who}: the step takes {len(grads)} gradients with autopp.grad / autopp.value_and_grad "
            f"({', '.join(_grad_call_name(closed.jaxpr.eqns[i].params['spec']) for i in grads)}); exactly one is "
            "supported. A call inside a loop (lax.scan, fori_loop, a Python for loop) counts once per iteration: call "
            "it once, at the top level of the step; a loop that accumulates gradients over microbatches is what "
            "autopp does itself (drop it and pass the whole batch, with num_microbatches= if you want a count). "
            "Combine the losses into one function, or take the others with jax.grad on the whole batch: the "
            "pipelined loss may read what they compute (a GAN: the discriminator's step by jax.grad, then the "
            "generator's by autopp.value_and_grad, its loss reading the updated discriminator)."
        )
    closed, zeroed = freeze_zero_gradients(closed, grads[0])  # stop_gradient'ed or dropped weights: frozen
    traced = TracedStep(
        jaxpr=closed,
        in_tree=in_tree,
        out_tree=out_tree,
        grad_index=grads[0],
        batch_mask=batch_mask,
        leaf_paths=leaf_paths,
        batch_argnums=batch_argnums,
        zeroed_gradients=tuple(zeroed.items()),
    )
    if probe_shapes:
        grows, stays = _shape_batched(step_fn, in_tree, abstract, traced)
        traced = dataclasses.replace(traced, shape_batched=grows, whole_batch_arrays=stays)
    if not any(traced.microbatched_grad_inputs):
        last = len(args) - 1
        fixed = [traced.grad_eqn.invars[k].aval.str_short() for k in traced.whole_batch_arrays]
        if fixed:  # read from the batch, but not growing with it
            raise ValueError(
                f"{who}: the loss reads values the step computes from the batch (batch_argnums={batch_argnums}) that "
                f"keep their size when the batch grows ({', '.join(fixed[:4])}: x[:8], top_k(..., 8), a replay "
                "buffer's rows picked by indices), so no batch axis splits. If another argument holds the examples "
                "(the indices), name it in batch_argnums; else slice a fraction of the batch (x[: x.shape[0] // 2]).")
        if not batch_argnums:
            raise ValueError(
                f"{who}: batch_argnums=() names no batch argument, but autopp splits the loss's batch (its examples, "
                "along axis 0) into microbatches and over data-parallel devices, so the step needs one. A step that "
                "draws its examples inside from a key (collocation points, noise samples): draw them before the step "
                "and pass them in as an argument, and name its position in batch_argnums (by default the last "
                f"argument, {last}).")
        raise ValueError(
            f"{who}: the loss reads nothing from the batch argument(s) batch_argnums={batch_argnums} "
            f"(args[{'], args['.join(map(str, batch_argnums))}]), so there is nothing to split into microbatches. "
            f"batch_argnums names the step arguments that hold the batch; pass the batch's position (by default the "
            f"last argument, {last}).")
    return _hoisted(traced, step_fn, args, who) if probe_shapes else traced


def _hoisted(traced: TracedStep, step_fn: Callable, args: Sequence[Any], who: str) -> TracedStep:
    """``traced`` with the loss's heavy work that is the same for every microbatch computed once per step
    (:func:`autopp.core._hoist.hoist_batch_independent_work`), where the step traced at twice the batch shows that
    work's results keeping their shapes (not so for work on ``jnp.zeros((x.shape[0], d))``)."""
    zeroed = traced.zeroed_gradients
    same = _same_in_every_microbatch(traced)
    done = hoist_batch_independent_work(traced.jaxpr, traced.grad_index, same, [v for v, _ in zeroed],
                                        evaluate=_eval_inlining)
    if done is None:
        return traced
    closed, index, kept = done
    probe = _at_twice_the_batch(step_fn, args, traced)
    try:
        if probe is None:
            raise ValueError
        hoisted_like(probe.spec.forward, closed.jaxpr.eqns[index].params["spec"], same[:len(probe.grad_eqn.invars)],
                     who)
    except ValueError:
        return traced
    return dataclasses.replace(traced, jaxpr=closed, grad_index=index,
                               zeroed_gradients=tuple((v, k) for v, (_, k) in zip(kept, zeroed)))


def _shape_batched(step_fn: Callable, in_tree, abstract: Sequence[jax.ShapeDtypeStruct],
                   traced: TracedStep) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(loss inputs that grow with the batch although no data flows into them from it, loss inputs computed from the
    batch's data that do not grow with it): the step traced again with every batch leaf's leading dimension doubled,
    a loss input whose leading dimension doubles too, or stays. Only inputs that could be one are looked at: not
    differentiated; for the first, not derived from the batch's data, a leading dimension that the batch size
    divides or that divides it (one row per group of consecutive examples: negatives shared per chunk); for the second, arrays the step derives from its data (not batch leaves themselves), when one of them
    has a leading dimension that is no batch leaf's (a step whose loss inputs all look per example traces once; one
    whose whole-batch value happens to have the batch's leading dimension is refused at the microbatch trace). With
    none, or when the step does not trace at twice the batch, none."""
    invars = traced.grad_eqn.invars
    sizes = [a.shape[0] for a, b in zip(abstract, traced.batch_mask) if b and a.shape]
    if not sizes:
        return (), ()
    batch = int(np.gcd.reduce(sizes))
    candidates = [k for k, (a, d, diff) in enumerate(zip(invars, traced._batch_derived_grad_inputs,
                                                          traced.spec.diff_mask))
                  if not d and not diff and not isinstance(a, jex_core.Literal)
                  and getattr(a.aval, "shape", ()) and a.aval.shape[0] > 1
                  and (a.aval.shape[0] % batch == 0 or batch % a.aval.shape[0] == 0)]  # (or one per group: chunks)
    outer = set(traced.jaxpr.jaxpr.invars)
    derived = [k for k, a in enumerate(invars)  # (differentiated too: SAM's params + eps, eps from a batch gradient)
               if traced._batch_derived_grad_inputs[k] and not isinstance(a, jex_core.Literal) and a not in outer
               and getattr(a.aval, "shape", ())]
    if not any(invars[k].aval.shape[0] not in sizes or traced.spec.diff_mask[k] for k in derived):  # all look per
        # example (and none is differentiated, else refused as split with the batch): no second trace
        derived = []
    if not candidates and not derived:
        return (), ()
    doubled = [abstract_leaf(a, shape=(2 * a.shape[0],) + tuple(a.shape[1:])) if b and a.shape else a
               for a, b in zip(abstract, traced.batch_mask)]
    try:
        probe = trace_step(step_fn, jax.tree_util.tree_unflatten(in_tree, doubled), traced.batch_argnums,
                           probe_shapes=False)
    except Exception:  # noqa: BLE001 - a step that only traces at its own batch size keeps the data-flow view
        return (), ()
    grown = probe.grad_eqn.invars
    if len(grown) != len(invars):
        return (), ()
    return (tuple(k for k in candidates
                  if getattr(grown[k].aval, "shape", ()) and grown[k].aval.shape[0] == 2 * invars[k].aval.shape[0]),
            tuple(k for k in derived if getattr(grown[k].aval, "shape", None) == invars[k].aval.shape))


def _at_twice_the_batch(step_fn: Callable, args: Sequence[Any], traced: TracedStep) -> TracedStep | None:
    """The step traced again with every batch leaf's leading dimension doubled (None where it does not trace)."""
    flat, in_tree = jax.tree_util.tree_flatten(tuple(args))
    doubled = [abstract_leaf(x, shape=(2 * np.shape(x)[0],) + tuple(np.shape(x)[1:])) if b and np.shape(x)
               else abstract_leaf(x) for x, b in zip(flat, traced.batch_mask)]
    try:
        return trace_step(step_fn, jax.tree_util.tree_unflatten(in_tree, doubled), traced.batch_argnums,
                          probe_shapes=False)
    except Exception:  # noqa: BLE001 - a step that only traces at its own batch size
        return None


def _misaligned(step_fn: Callable, args: Sequence[Any], traced: TracedStep) -> str:
    """Loss inputs kept whole (not split into microbatches) whose size grows with the batch along another axis than
    the first, found by tracing the step at twice the batch, said as a sentence ("" for none)."""
    probe = _at_twice_the_batch(step_fn, args, traced)
    if probe is None:  # nothing more to say
        return ""
    found = []
    for k, (a, b, mb) in enumerate(zip(traced.grad_eqn.invars, probe.grad_eqn.invars,
                                       traced.microbatched_grad_inputs)):
        small, big = getattr(a.aval, "shape", ()), getattr(b.aval, "shape", ())
        if mb or len(small) != len(big):
            continue
        axes = [d for d, (x, y) in enumerate(zip(small, big)) if x != y]
        if axes and axes[0] > 0:
            found.append(f"loss input {traced.spec.input_name(k)} of shape {tuple(small)} (batch axis {axes[0]})")
    if not found:
        return ""
    return (f" Values the step computes with the batch along another axis than the first are passed to every "
            f"microbatch whole: {', '.join(found)}. Put the batch axis first (jnp.moveaxis(value, axis, 0), and index "
            "it so in the loss), or compute the value inside the loss.")


@contextlib.contextmanager
def _at_microbatch_size(who: str, num_microbatches: int, traced: TracedStep | None = None,
                        misaligned: Callable[[], str] = lambda: ""):
    """Errors of the step traced at microbatch size, said as such: the step traced at full size, so what failed is
    almost always a batch leaf that has no batch axis, code that assumes the full batch size, or a batch argument
    ``batch_argnums`` leaves out (the leaves of other arguments with the batch's leading dimension are named), or a
    value the step makes with the batch along another axis than the first (``misaligned()`` names them)."""
    try:
        yield
    except (TypeError, ValueError) as e:
        sparse = sparse_batch_leaves(traced) if traced is not None else []
        if sparse:
            raise sparse_refusal(who, num_microbatches, sparse) from e
        left_out = misaligned()
        if traced is not None:
            invars = traced.jaxpr.jaxpr.invars
            sizes = {v.aval.shape[0] for v, b in zip(invars, traced.batch_mask) if b and v.aval.shape}
            # not the parameters, nor state shaped like them that the loss does not read (an optimizer's moments)
            params = {a for a, d in zip(traced.grad_eqn.invars, traced.spec.diff_mask) if d}
            like_params = {(a.aval.shape, a.aval.dtype) for a in params}
            names = [n for v, b, n in zip(invars, traced.batch_mask, traced.leaf_paths) if not b and v.aval.shape
                     and v.aval.shape[0] in sizes and v not in params  # (a PINN's weight per point, read by the loss)
                     and ((v.aval.shape, v.aval.dtype) not in like_params or v in traced.grad_eqn.invars)]
            if names:
                left_out += (f" Leaves outside batch_argnums={traced.batch_argnums} with the batch's leading "
                             f"dimension, kept whole: {', '.join(names[:6])}{' ...' if len(names) > 6 else ''}; if "
                             "they belong to the batch, add their argument to batch_argnums.")
            stacked = [n for v, n in zip(invars, traced.leaf_paths) if v in params and v.aval.shape
                       and v.aval.shape[0] in sizes]
            if stacked and not names and ("inconsistent sizes" in str(e) or "incompatible shapes" in str(e)):  # (a
                # vmap's or an elementwise op's error, no other leaf to blame: per-client heads, per-point weights)
                left_out += (f" Parameters with the batch's leading dimension, read whole by every microbatch: "
                             f"{', '.join(stacked[:4])}{' ...' if len(stacked) > 4 else ''}; where each row belongs to "
                             "one example (a client's own head, a self-adaptive PINN's weight per point), pass each "
                             "example's index with the batch and read its rows, heads[ids], or num_microbatches=1.")
        raise ValueError(
            f"{who}: the step traces at the full batch but fails at microbatch size (every batch leaf's leading "
            f"dimension divided by num_microbatches={num_microbatches}): {type(e).__name__}: {e}\nA batch leaf "
            "without a batch axis (a position table, class weights) belongs in another argument of the step "
            "(batch_argnums names the batch); code that assumes the full batch size should read it from the "
            "arrays' shapes; a loss that groups consecutive examples (pairs read as x.reshape(-1, 2)) needs "
            f"microbatches of a multiple of the group: choose num_microbatches so.{left_out}") from e


def check_gradient_not_split(traced: TracedStep, num_microbatches: int, who: str = "autopp.parallelize") -> None:
    """Refuse a gradient taken with respect to values split into microbatches (a batch input, or arguments that
    ``batch_argnums`` wrongly names as the batch): each microbatch would have its own."""
    split = [k for k, (d, mb) in enumerate(zip(traced.spec.diff_mask, traced.microbatched_grad_inputs)) if d and mb]
    if not split or num_microbatches == 1:
        return
    outer = traced.jaxpr.jaxpr.invars
    by_gradient = dict(zip(traced.spec.diff_indices, traced.spec.grad_names))
    names = [traced.leaf_paths[outer.index(a)] for k in split for a in [traced.grad_eqn.invars[k]] if a in outer]
    inner = [by_gradient[k] for k in split if traced.grad_eqn.invars[k] not in outer]  # (computed in the step)
    if inner:
        names.append(f"the loss's inputs computed from the batch in the step whose gradients are {', '.join(inner[:4])}"
                     + (f" and {len(inner) - 4} more" if len(inner) > 4 else ""))
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    raise ValueError(
        f"{who}: the gradient is taken with respect to {shown}, which is split into microbatches as part of the "
        f"batch (batch_argnums={traced.batch_argnums}); its gradient would be per microbatch. If those are the "
        "parameters, batch_argnums names the wrong argument: give the position(s) of the step argument(s) holding "
        "the batch (by default the last). Otherwise take the gradient with respect to parameters only (argnums), "
        "and compute an input gradient (saliency, adversarial examples) with jax.grad outside the parallelized step.")


_RETRYING = threading.local()


def trace_microbatch_forward(step_fn: Callable, args: Sequence[Any], traced: TracedStep,
                             num_microbatches: int, who: str = "autopp.parallelize") -> jex_core.ClosedJaxpr:
    """The loss's forward jaxpr at microbatch size (what each pipeline stage runs per microbatch); see
    :func:`_trace_microbatch_forward`. Where it fails at that size, the refusal names the smaller counts that trace
    (a loss that reshapes its examples into groups, patches of rays: microbatches of whole groups)."""
    try:
        return _trace_microbatch_forward(step_fn, args, traced, num_microbatches, who)
    except ValueError as e:
        if "fails at microbatch size" not in str(e) or getattr(_RETRYING, "on", False):
            raise
        sizes = [v.aval.shape[0] for v, b in zip(traced.jaxpr.jaxpr.invars, traced.batch_mask) if b and v.aval.shape]
        size = np.gcd.reduce(sizes) if sizes else 1
        works = []
        _RETRYING.on = True
        try:
            for k in [k for k in range(num_microbatches - 1, 1, -1) if size % k == 0][:4]:
                with contextlib.suppress(ValueError, TypeError):
                    _trace_microbatch_forward(step_fn, args, traced, k, who)
                    works.append(k)
        finally:
            _RETRYING.on = False
        if not works:
            raise
        raise ValueError(f"{e} It traces at num_microbatches={' or '.join(map(str, works[:2]))}.") from e


def _trace_microbatch_forward(step_fn: Callable, args: Sequence[Any], traced: TracedStep,
                              num_microbatches: int, who: str = "autopp.parallelize") -> jex_core.ClosedJaxpr:
    """The loss's forward jaxpr at microbatch size (what each pipeline stage runs per microbatch).

    The loss inputs derived from the batch shrink by ``num_microbatches`` along axis 0, everything else must not
    change. When the loss closes over nothing traced in the step (``GradSpec.loss_fn``) and reads the batch leaves as
    the step received them, only the loss is traced again, at those shapes; otherwise the step is traced again with
    every batch leaf's leading dimension divided.
    """
    check_gradient_not_split(traced, num_microbatches, who)
    spec = traced.spec
    batch_leaves = {v for v, b in zip(traced.jaxpr.jaxpr.invars, traced.batch_mask) if b}
    direct = all(a in batch_leaves for a, is_mb in zip(traced.grad_eqn.invars, traced.microbatched_grad_inputs)
                 if is_mb)
    if spec.loss_fn is not None and direct:  # the batch goes to the loss as it is: shrink it there
        mb_forward = _loss_at_microbatch_size(step_fn, args, traced, num_microbatches, who)
    else:
        flat, in_tree = jax.tree_util.tree_flatten(tuple(args))
        small = []
        for x, is_batch in zip(flat, traced.batch_mask):
            shape = tuple(np.shape(x))
            if is_batch:
                shape = (shape[0] // num_microbatches,) + shape[1:]
            small.append(abstract_leaf(x, shape=shape))
        try:
            with _at_microbatch_size(who, num_microbatches, traced, lambda: _misaligned(step_fn, args, traced)):
                mb = trace_step(step_fn, jax.tree_util.tree_unflatten(in_tree, small), traced.batch_argnums, who,
                                probe_shapes=False)
            mb_forward = hoisted_like(mb.spec.forward, spec, _same_in_every_microbatch(traced)[
                :len(mb.grad_eqn.invars)], who)
        except ValueError:
            # Step code that only runs at the full batch (rewards normalised in groups larger than a microbatch):
            # the runtime runs it on the whole batch anyway and splits the loss inputs by rows, so the loss alone
            # at those rows is what each microbatch runs, once the step at twice the batch shows every split input
            # growing along axis 0 and nothing else growing.
            if spec.loss_fn is None or not _rows_grow_along_axis_0(step_fn, args, traced):
                raise
            mb_forward = _loss_at_microbatch_size(step_fn, args, traced, num_microbatches, who)
    mb_in = [v.aval for v in mb_forward.jaxpr.invars]
    full_in = [a.aval for a in traced.grad_eqn.invars]
    outer = traced.jaxpr.jaxpr.invars
    problems, same_shape, added = [], 0, 0
    batch = int(np.gcd.reduce([v.aval.shape[0] for v, b in zip(outer, traced.batch_mask) if b and v.aval.shape] or [1]))
    for k, (f, m, is_mb) in enumerate(zip(full_in, mb_in, traced.microbatched_grad_inputs)):
        a = traced.grad_eqn.invars[k]
        name = "loss input " + traced.spec.input_name(k) + (f" ({traced.leaf_paths[outer.index(a)]})" if a in outer
                                                            else " (computed in the step from the batch)" * is_mb)
        expect = (f.shape[0] // num_microbatches,) + f.shape[1:] if is_mb and f.shape else f.shape
        if is_mb and (not f.shape or f.shape[0] % num_microbatches):
            problems.append(f"  {name}: shape {f.shape} derives from the batch but has no leading "
                            f"dimension divisible by {num_microbatches}")
        elif m.shape != expect or m.dtype != f.dtype:
            problems.append(f"  {name}: {f.str_short()} at full batch, {m.str_short()} per microbatch "
                            f"(expected {expect})")
            same_shape += is_mb and m.shape == f.shape
            added += bool(is_mb and m.shape and f.shape[0] - m.shape[0] == batch - batch // num_microbatches)
    if len(full_in) != len(mb_in) or problems:
        raise ValueError(
            f"{who}: the loss inputs do not scale with the batch, so the batch cannot be split "
            "into microbatches along axis 0:\n" + "\n".join(problems) + "\nKeep the batch dimension first in "
            "everything the step passes from the batch to the loss. A value the step computes from the whole batch "
            "and the loss reads (a batch statistic, parameters updated by another gradient over the batch) is read "
            "whole by every microbatch when the step's loss inputs show it (one of them has a leading dimension that "
            "is no batch leaf's); where every such value's leading dimension is the batch size, each is taken for a "
            "per-example one: compute it inside the loss, or from the previous step's values. A value the loss must "
            "read whole that grows with the batch along another axis (the whole batch's keys as negatives, k[None], "
            "or a queue concatenated with them) cannot be split: use num_microbatches=1 (a stage's data-parallel "
            "devices then compute over the whole batch, as jit does)." + (
                "\nA loss input that keeps its shape per microbatch is such a value whose leading dimension equals "
                "the batch size by chance (a mean over the batch per time step, with as many steps as examples): "
                "give it a leading axis of 1 (x.mean(0, keepdims=True)) and every microbatch reads it whole, as "
                "under jax.jit." if same_shape else "") + (
                "\nA loss input with the batch's examples plus a fixed number of other rows (replay rows added in "
                "the step) cannot be split: add them to the batch before the step, or pass them to the loss apart "
                "and add the parts' sums, (nll(x).sum() + nll(replay).sum()) / n, n from the step." if added else "")
        )
    refuse_reads_past_rows(mb_forward, traced, num_microbatches, who)
    refuse_batch_positions(mb_forward, traced, who)
    return mb_forward


def _loss_at_microbatch_size(step_fn: Callable, args: Sequence[Any], traced: TracedStep, num_microbatches: int,
                             who: str) -> jex_core.ClosedJaxpr:
    """The loss alone (``GradSpec.loss_fn``) traced with its microbatched inputs' rows divided by
    ``num_microbatches``, the rest as the step passes them."""
    small, spec = [], traced.spec
    loss_inputs = len(traced.grad_eqn.invars) - spec.num_hoisted
    for a, f, is_mb in zip(traced.grad_eqn.invars[:loss_inputs], spec.forward.jaxpr.invars,
                           traced.microbatched_grad_inputs):  # (weak as the loss saw it: a jnp.array(0.0) weight)
        shape = tuple(a.aval.shape)
        if is_mb and shape and shape[0] % num_microbatches == 0:
            shape = (shape[0] // num_microbatches,) + shape[1:]
        small.append(jax.ShapeDtypeStruct(shape, a.aval.dtype, weak_type=getattr(f.aval, "weak_type", False)))
    with _tracing(), _at_microbatch_size(who, num_microbatches, traced, lambda: _misaligned(step_fn, args, traced)):
        loss = drop_sharding_constraints(jax.make_jaxpr(spec.loss_fn)(*small), who)
        loss = sink_parameter_work(loss, spec.sunk_mask or spec.diff_mask)
    return hoisted_like(loss, spec, _same_in_every_microbatch(traced)[:loss_inputs], who)


def _same_in_every_microbatch(traced: TracedStep) -> list[bool]:
    """Per loss input: whether it comes from no batch leaf nor the batch's shape (weights, a graph passed whole)."""
    return [not d and not isinstance(a, jex_core.Literal)
            for a, d in zip(traced.grad_eqn.invars, traced._batch_derived_grad_inputs)]


def _rows_grow_along_axis_0(step_fn: Callable, args: Sequence[Any], traced: TracedStep) -> bool:
    """Whether the step traced at twice the batch gives every microbatched loss input twice its rows (the other
    dimensions equal) and every other loss input its shape unchanged."""
    probe = _at_twice_the_batch(step_fn, args, traced)
    if probe is None or len(probe.grad_eqn.invars) != len(traced.grad_eqn.invars):
        return False  # no evidence either way: keep the microbatch trace's error
    for a, b, mb in zip(traced.grad_eqn.invars, probe.grad_eqn.invars, traced.microbatched_grad_inputs):
        small, big = tuple(getattr(a.aval, "shape", ())), tuple(getattr(b.aval, "shape", ()))
        if big != ((2 * small[0],) + small[1:] if mb and small else small):
            return False
    return True
