"""``autopp.grad`` / ``autopp.value_and_grad``: JAX's own functions, plus a marker for ``parallelize``.

Outside :func:`autopp.parallelize` they *are* ``jax.grad`` / ``jax.value_and_grad``. While
``parallelize`` traces a step they bind :data:`value_and_grad_p`, one equation that carries the
forward jaxpr of the loss; the pipeline is built from that forward and its per-stage VJPs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

from autopp.core import _compat
from autopp.core._constraints import drop_sharding_constraints
from autopp.core._jaxpr import eval_closed, sink_parameter_work

_state = threading.local()


@contextlib.contextmanager
def marking_gradients():
    """While active, autopp.grad binds :data:`value_and_grad_p` instead of differentiating."""
    depth = getattr(_state, "depth", 0)
    _state.depth = depth + 1
    try:
        yield
    finally:
        _state.depth = depth


def _marking() -> bool:
    return getattr(_state, "depth", 0) > 0


@contextlib.contextmanager
def _not_marking():
    """Inside the marked loss: a gradient taken there (a gradient penalty, a MAML inner step) is part of the loss,
    so ``autopp.grad`` is ``jax.grad`` again."""
    depth = getattr(_state, "depth", 0)
    _state.depth = 0
    try:
        yield
    finally:
        _state.depth = depth


@dataclasses.dataclass(frozen=True, eq=False)
class GradSpec:
    """What one ``autopp.value_and_grad`` call differentiates (the static part of the equation).

    ``forward`` has invars ``[*lifted, *flat_args]``: ``lifted`` are values the loss closes over that
    were traced in the step; ``flat_args`` the flattened positional arguments. Outvars are
    ``[loss, *aux_leaves]``.
    """

    forward: jex_core.ClosedJaxpr
    num_lifted: int
    diff_mask: tuple[bool, ...]  # over forward invars
    has_aux: bool
    aux_tree: Any
    grad_tree: Any  # tree of the gradients (args[argnums]); an integer leaf (allow_int) gets float0 zeros
    name: str
    fn_name: str = ""
    """The differentiated function's ``__name__`` (``dloss``), for messages."""
    loss_fn: Callable | None = None
    """The flattened loss (``flat_args -> [loss, *aux_leaves]``) when it closes over nothing traced in the step
    (``num_lifted == 0``): the loss alone can then be traced again at other shapes (the microbatch forward) without
    tracing the step again."""
    sunk_mask: tuple[bool, ...] | None = None
    """The inputs ``forward``'s parameter work was moved down after (:func:`autopp.core.sink_parameter_work`) where
    they differ from :attr:`diff_mask` (a weight found to get no gradient, frozen after ``forward`` was made): a
    trace of the loss at another batch size moves it after the same ones, so that both programs match equation by
    equation."""
    num_hoisted: int = 0
    """How many of ``forward``'s last inputs are values the step computes once, before the gradient, from inputs the
    same for every microbatch (:mod:`autopp.core._hoist`: a whole-graph encoder of the parameters): the loss reads
    them, and the step adds their gradients' backward to the parameters' gradients after it."""
    returned_mask: tuple[bool, ...] | None = None
    """The inputs whose gradients the call returns where they differ from :attr:`diff_mask` (a weight only the
    hoisted work reads gets its gradient from that work's backward, not from this equation)."""
    arg_paths: tuple[str, ...] = ()
    """Each array argument of the loss as the call passed it (``args[1]['x']``), in ``forward``'s order after the
    lifted values."""

    def input_name(self, k: int) -> str:
        """``forward``'s input ``k`` as the user knows it: an argument's path, else what it is."""
        j = k - self.num_lifted
        if j < 0:
            return f"a value the loss closes over (#{k})"
        if j < len(self.arg_paths):
            return self.arg_paths[j]
        return f"a value computed once per step from the parameters (#{k})"

    @property
    def num_aux(self) -> int:
        return len(self.forward.out_avals) - 1

    @property
    def diff_indices(self) -> tuple[int, ...]:
        return tuple(i for i, d in enumerate(self.diff_mask) if d)

    @property
    def aux_names(self) -> list[str]:
        """Each aux leaf of the loss as the user wrote it (``aux['pred']``, ``aux[0]``); ``aux`` for one array."""
        if not self.has_aux:
            return []
        numbered = jax.tree_util.tree_unflatten(self.aux_tree, list(range(self.num_aux)))
        return ["aux" + "".join(_key_str(k, node) for k, node in steps) for steps in _paths(numbered)]

    @property
    def grad_names(self) -> list[str]:
        """Each differentiated input named by its gradient's place in what the call returns (``grads[1]['h']`` with
        ``argnums=(0, 1)``), in the order of :attr:`diff_indices`."""
        returned = [k for k, d in enumerate(self.returned_mask or self.diff_mask) if d]
        n = len(returned)
        if self.grad_tree is None or self.grad_tree.num_leaves != n:
            names = [f"differentiated input {k}" for k in range(n)]
        else:
            numbered = jax.tree_util.tree_unflatten(self.grad_tree, list(range(n)))
            names = ["grads" + "".join(_key_str(k, node) for k, node in steps) for steps in _paths(numbered)]
        by_input = dict(zip(returned, names))
        return [by_input.get(k, "a value the loss computes from the parameters alone") for k in self.diff_indices]

    def __hash__(self):
        return id(self)


def _paths(tree, steps=()) -> list:
    """Each leaf's path as ``(key, the node it is read from)`` pairs, one level at a time (a node flattened without
    keys, an Equinox ``State``, is then named by its type)."""
    if not jax.tree_util.tree_leaves(tree):
        return []
    level = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is not tree)[0]
    if level[0][1] is tree:
        return [steps]
    return [p for path, child in level for p in _paths(child, steps + ((path[0], tree),))]


def _key_str(key, node) -> str:
    if isinstance(key, jax.tree_util.FlattenedIndexKey):
        return f"[<{type(node).__name__} leaf {key.key}>]"
    return jax.tree_util.keystr((key,))


def _vag_impl(*args, spec: GradSpec):
    diff_idx = spec.diff_indices

    def loss_of_diff(diff_vals):
        vals = list(args)
        for i, v in zip(diff_idx, diff_vals):
            vals[i] = v
        outs = eval_closed(spec.forward, *vals)
        return outs[0], outs[1:]

    (loss, aux), grads = jax.value_and_grad(loss_of_diff, has_aux=True)([args[i] for i in diff_idx])
    return [loss, *aux, *grads]


def _vag_abstract_eval(*avals, spec: GradSpec):
    outs = list(spec.forward.out_avals)
    return outs + [avals[i] for i in spec.diff_indices]


value_and_grad_p = jex_core.Primitive("autopp_value_and_grad")
value_and_grad_p.multiple_results = True
value_and_grad_p.def_impl(_vag_impl)
value_and_grad_p.def_abstract_eval(_vag_abstract_eval)
_compat.register_fallback_lowering(value_and_grad_p, _vag_impl)
_CHECKIFY = (
    "autopp.parallelize: checkify does not see inside the loss given to autopp.value_and_grad / autopp.grad, which "
    "autopp traces and splits into stages itself: its checks there (checkify.check, debug_check, the automatic NaN "
    "and index checks) would be lost. Check in the step, outside the gradient (on the loss, the gradients or the "
    "batch), or print from the loss with jax.debug.print.")
_compat.refuse_checkify(value_and_grad_p, _CHECKIFY)
_compat.refuse_batching(value_and_grad_p, (
    "autopp.parallelize: autopp.grad / autopp.value_and_grad is called under jax.vmap in the step; the pipelined "
    "gradient is one call at the top level of the step. Per-example gradients (MAML's inner step, a gradient "
    "penalty) are jax.grad's, inside the loss. Per-task gradients over the whole batch that decide one update "
    "(PCGrad, MGDA, GradNorm) are not: computed inside the loss they would be each microbatch's. Take them with "
    "jax.grad in the step on the whole batch and pass what they decide (the tasks' weights) to one autopp.grad of "
    "the weighted loss; or give each task its own copy of the shared weights, stacked, each task's loss reading its "
    "copy, so that one autopp.grad returns every task's gradient. A vmap over microbatches to accumulate gradients "
    "is what autopp does itself (pass the whole batch, with num_microbatches=)."))


def _as_tuple_argnums(argnums, num_args: int) -> tuple[int, ...]:
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    if not nums or not all(isinstance(a, int) for a in nums):
        raise TypeError(f"argnums must be an int or a non-empty sequence of ints, got {argnums!r}.")
    out = []
    for a in nums:
        if not -num_args <= a < num_args:
            raise ValueError(
                f"argnums {argnums!r} refers to argument {a}, but the function was called with "
                f"{num_args} positional argument(s)."
            )
        out.append(a % num_args)
    return tuple(out)


def _array_like(leaf) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic, bool, int, float, complex)) or _compat.is_tracer(leaf)


def _bind(fun: Callable, argnums, has_aux: bool, allow_int: bool, args, kwargs, name: str):
    if kwargs:
        fun = functools.partial(fun, **kwargs)
    nums = _as_tuple_argnums(argnums, len(args))
    flat_args, in_tree = jax.tree_util.tree_flatten(list(args))
    paths = ["args" + jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(list(args))[0]]
    leaf_counts = [len(jax.tree_util.tree_leaves(a)) for a in args]
    starts = np.cumsum([0] + leaf_counts)
    arg_mask = [False] * len(flat_args)
    for a in nums:
        for i in range(starts[a], starts[a + 1]):
            arg_mask[i] = True
    # Leaves that are not arrays (a string, None, a function) outside argnums are static, as jax.grad closes over them,
    # and so are Python and NumPy numbers outside argnums (a dropout rate, a `train` flag): the loss may branch on them
    static = {i: leaf for i, leaf in enumerate(flat_args) if not _array_like(leaf)
              or (isinstance(leaf, (bool, int, float, complex, np.generic)) and not arg_mask[i])}
    for i, leaf in static.items():
        if arg_mask[i]:
            raise TypeError(f"{name}: argument(s) {nums} to differentiate hold a {type(leaf).__name__} ({leaf!r:.40}), "
                            "which is not an array; differentiate only arrays and pass the rest as other arguments.")
    integer = [d and not jnp.issubdtype(jnp.result_type(leaf), jnp.inexact) for leaf, d in zip(flat_args, arg_mask)]
    for leaf, is_int in zip(flat_args, integer):
        if is_int and not allow_int:
            raise TypeError(
                f"{name} requires real- or complex-valued inputs (input dtype that is a sub-dtype of "
                f"np.inexact), but got {jnp.result_type(leaf).name} for a leaf of argument(s) {nums}. If you want "
                "to use integer-valued inputs, pass allow_int=True or move the leaf out of argnums."
            )
    # allow_int: an integer leaf is not differentiated; its gradient is float0 zeros, as jax.grad gives
    in_argnums, arg_mask = arg_mask, [d and not is_int for d, is_int in zip(arg_mask, integer)]

    num_leaves = len(flat_args)
    dynamic = [i for i in range(num_leaves) if i not in static]

    def flat_fun(*leaves):
        full = dict(static)
        full.update(zip(dynamic, leaves))
        with _not_marking(), _compat.tracing_loss(leaves, arg_mask):
            out = fun(*jax.tree_util.tree_unflatten(in_tree, [full[i] for i in range(num_leaves)]))
        if has_aux:
            if not (isinstance(out, tuple) and len(out) == 2):
                raise TypeError(
                    f"{name} with has_aux=True requires the function to return a (loss, aux) pair, "
                    f"got {type(out).__name__}."
                )
            loss, aux = out
        else:
            loss, aux = out, None
            if isinstance(out, (tuple, list, dict)):  # jnp.asarray would fail on it with a message about dtypes
                raise TypeError(
                    f"{name}: the differentiated function must return a real scalar loss, got a "
                    f"{type(out).__name__} ({jax.tree_util.tree_structure(out)}). If it returns (loss, aux), pass "
                    "has_aux=True.")
        loss = jnp.asarray(loss) if not _compat.is_tracer(loss) else loss
        if jnp.shape(loss) != () or not jnp.issubdtype(jnp.result_type(loss), jnp.floating):
            raise TypeError(
                f"{name}: the differentiated function must return a real scalar loss, got "
                f"{jax.typeof(loss)}. Reduce the loss to a scalar (e.g. with jnp.mean)."
            )
        aux_leaves, aux_tree = jax.tree_util.tree_flatten(aux)
        flat_fun.aux_tree = aux_tree
        return [loss, *aux_leaves]

    all_args, flat_args, arg_mask = flat_args, [flat_args[i] for i in dynamic], [arg_mask[i] for i in dynamic]
    try:
        closed = drop_sharding_constraints(jax.make_jaxpr(flat_fun)(*flat_args))
    except ValueError as e:
        if "checkify.check which was not functionalized" in str(e):
            raise ValueError(_CHECKIFY) from None
        raise
    aux_tree = flat_fun.aux_tree
    jaxpr = closed.jaxpr
    # Values the loss closes over that belong to the surrounding trace become explicit inputs.
    lifted_vars, lifted_vals, kept_vars, kept_vals = [], [], [], []
    for v, c in zip(jaxpr.constvars, closed.consts):
        if _compat.is_tracer(c):
            lifted_vars.append(v)
            lifted_vals.append(c)
        else:
            kept_vars.append(v)
            kept_vals.append(c)
    diff_mask = tuple([False] * len(lifted_vars) + arg_mask)
    forward = sink_parameter_work(jex_core.ClosedJaxpr(
        _compat.new_jaxpr(kept_vars, [*lifted_vars, *jaxpr.invars], jaxpr.outvars, jaxpr.eqns, jaxpr.effects, name),
        kept_vals,
    ), diff_mask)
    grad_args = [args[a] for a in nums]
    grad_tree = jax.tree_util.tree_structure(grad_args[0] if isinstance(argnums, int) else tuple(grad_args))
    spec = GradSpec(
        forward=forward,
        num_lifted=len(lifted_vars),
        diff_mask=diff_mask,
        has_aux=has_aux,
        aux_tree=aux_tree,
        grad_tree=grad_tree,
        name=name,
        fn_name=getattr(fun, "__name__", ""),
        loss_fn=flat_fun if not lifted_vars else None,
        arg_paths=tuple(paths[i] for i in dynamic) if len(paths) == num_leaves else (),
    )
    outs = value_and_grad_p.bind(*lifted_vals, *flat_args, spec=spec)
    loss, aux_leaves, diff_grads = outs[0], outs[1 : 1 + spec.num_aux], iter(outs[1 + spec.num_aux :])
    by_leaf = {i: np.zeros(np.shape(leaf), jax.dtypes.float0) if is_int else next(diff_grads)
               for i, (leaf, d, is_int) in enumerate(zip(all_args, in_argnums, integer)) if d}
    grads = [by_leaf[i] for a in nums for i in range(starts[a], starts[a + 1])]  # in argnums' order, as jax.grad
    aux = jax.tree_util.tree_unflatten(aux_tree, aux_leaves)
    return loss, aux, jax.tree_util.tree_unflatten(grad_tree, grads)


def value_and_grad(
    fun: Callable,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    holomorphic: bool = False,
    allow_int: bool = False,
) -> Callable:
    """Exactly ``jax.value_and_grad``; inside :func:`autopp.parallelize` it also marks the loss.

    Returns ``(loss, grads)``, or ``((loss, aux), grads)`` with ``has_aux=True``.
    """
    jax_fn = jax.value_and_grad(fun, argnums, has_aux=has_aux, holomorphic=holomorphic, allow_int=allow_int)

    @functools.wraps(fun)
    def wrapper(*args, **kwargs):
        if not _marking():
            return jax_fn(*args, **kwargs)
        if holomorphic:
            raise ValueError("autopp.value_and_grad(holomorphic=True) is not supported inside autopp.parallelize.")
        loss, aux, grads = _bind(fun, argnums, has_aux, allow_int, args, kwargs, "autopp.value_and_grad")
        return ((loss, aux) if has_aux else loss), grads

    return wrapper


def grad(
    fun: Callable,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    holomorphic: bool = False,
    allow_int: bool = False,
) -> Callable:
    """Exactly ``jax.grad``; inside :func:`autopp.parallelize` it also marks the loss.

    Returns ``grads``, or ``(grads, aux)`` with ``has_aux=True``.
    """
    jax_fn = jax.grad(fun, argnums, has_aux=has_aux, holomorphic=holomorphic, allow_int=allow_int)

    @functools.wraps(fun)
    def wrapper(*args, **kwargs):
        if not _marking():
            return jax_fn(*args, **kwargs)
        if holomorphic:
            raise ValueError("autopp.grad(holomorphic=True) is not supported inside autopp.parallelize.")
        _, aux, grads = _bind(fun, argnums, has_aux, allow_int, args, kwargs, "autopp.grad")
        return (grads, aux) if has_aux else grads

    return wrapper
