"""Whether the batch splits into microbatches along axis 0: every batch leaf's leading dimension divisible, said
with the fix where it is not (a leaf without the batch's length, a sparse array)."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import jax
import numpy as np

from autopp.core._compat import user_line
from autopp.core._custom_vjp import backward_outputs
from autopp.core._warn import user_stacklevel

if TYPE_CHECKING:
    from autopp.core._trace import TracedStep

__all__ = ["check_batch_divisible", "refuse_overwritten_by_gradient", "sparse_batch_leaves", "sparse_leaf_mask",
           "sparse_refusal"]


def check_batch_divisible(traced: TracedStep, num_microbatches: int, who: str = "autopp.parallelize") -> None:
    """Every batch leaf's leading dimension must split into ``num_microbatches`` equal parts."""
    bad = []
    for v, is_batch, name in zip(traced.jaxpr.jaxpr.invars, traced.batch_mask, traced.leaf_paths):
        if is_batch and v.aval.shape[0] % num_microbatches:
            bad.append(f"  {name}: leading dimension {v.aval.shape[0]}")
    sparse = sparse_batch_leaves(traced) if num_microbatches > 1 else []
    if sparse:  # (its data and indices have as many rows as stored entries: split, they keep the whole shape)
        raise sparse_refusal(who, num_microbatches, sparse)
    leading = {name: v.aval.shape[0] for v, is_batch, name in zip(traced.jaxpr.jaxpr.invars, traced.batch_mask,
                                                                    traced.leaf_paths) if is_batch and v.aval.shape}
    if not bad and len(set(leading.values())) > 1 and num_microbatches > 1:
        shown = ", ".join(f"{name}: {n}" for name, n in list(leading.items())[:8])
        warnings.warn(
            f"{who}: the batch leaves have different leading dimensions ({shown}); each is split into "
            f"{num_microbatches} equal parts along axis 0 all the same. That is right for a leaf laid out by example "
            "with the same number of rows per example (tokens flattened to batch x sequence, say), wrong for one "
            "without a batch axis (class weights, a position table), which every microbatch needs whole: move such a "
            "leaf to another argument of the step (batch_argnums names the batch); and wrong for rows of varying "
            "number per example (multi-hot ids flattened with each one's example index): a part's rows are not its "
            "examples', and example indices count the whole batch's; pad such values per example ([batch, max "
            "length] with a mask).", stacklevel=3)
    if bad:
        sizes = [v.aval.shape[0] for v, b in zip(traced.jaxpr.jaxpr.invars, traced.batch_mask) if b]
        batch = max(set(sizes), key=lambda n: (sizes.count(n), n % num_microbatches == 0))  # (the batch size:
        # the leading dimension most leaves have, one that splits on a tie: a sparse array's data and indices)
        ok = [d for d in range(1, num_microbatches + 1) if all(s % d == 0 for s in sizes)]
        # only leaves without the batch's length are in the way (a count of shape (1,)), not batches of several
        # sizes (labelled and unlabelled examples), which another count splits alike
        odd = batch % num_microbatches == 0 and max(ok) == 1
        one_more = [line.split(":")[0].strip() for line, n in zip(bad, [int(b.rsplit(" ", 1)[-1]) for b in bad])
                    if n == batch + 1]  # (a rollout's T + 1 observations: the bootstrap one beside T rewards)
        extra = (f" A leaf with one row more than the batch ({', '.join(one_more)}): a rollout's T + 1 observations, "
                 "the last one to bootstrap from: keep its first rows in the batch and pass the last row as an "
                 "argument of its own (obs[:-1] in the batch, obs[-1] apart), from which the step computes the "
                 "bootstrap value; ragged rows' offsets (row_splits, B + 1 of them): pass each example's length, or "
                 "its rows padded ([B, max length] with a mask), instead." if odd and one_more else "")
        raise ValueError(
            f"{who}: the batch cannot be split into num_microbatches={num_microbatches} equal "
            "microbatches along axis 0; these batch leaves are not divisible:\n" + "\n".join(bad) + "\n"
            + (f"Their leading dimension is not the batch's ({batch} in most leaves). A leaf without a batch axis (a "
               "count, one PRNG key, a table, class weights) belongs in another argument of the step (batch_argnums "
               "names the batch)." + extra if odd else
               f"Use a num_microbatches that divides every batch leaf's leading dimension (e.g. {max(ok)}) or change "
               "the batch size. A leaf without a batch axis (one PRNG key, a table, class weights) belongs in another "
               "argument of the step (batch_argnums names the batch).")
        )


def sparse_batch_leaves(traced: TracedStep) -> list[str]:
    """The batch arguments' sparse arrays (``jax.experimental.sparse``), by type and where they are."""
    return list(_sparse_batch_arrays(traced))


def sparse_leaf_mask(traced: TracedStep) -> list[bool]:
    """Per leaf of the step's arguments, whether it belongs to a sparse array of the batch (its data or indices,
    whose leading dimension counts stored entries, not examples)."""
    mask = [False] * traced.in_tree.num_leaves
    for first, count in _sparse_batch_arrays(traced).values():
        mask[first:first + count] = [True] * count
    return mask


def _sparse_batch_arrays(traced: TracedStep) -> dict[str, tuple[int, int]]:
    """The batch arguments' sparse arrays: "a BCOO in args[2]['adj']" -> (its first leaf's index, its leaves)."""
    found: dict[str, tuple[int, int]] = {}

    def walk(node, where, first):
        data = node.node_data()
        kind = data[0] if data else None
        if kind is not None and getattr(kind, "__module__", "").startswith("jax.experimental.sparse"):
            found[f"a {kind.__name__} in {where}"] = (first, node.num_leaves)
            return
        keys = data[1] if kind is dict and data else None
        for k, child in enumerate(node.children()):
            walk(child, f"{where}[{keys[k]!r}]" if keys is not None else where, first)
            first += child.num_leaves

    first = 0
    for i, arg in enumerate(traced.in_tree.children()):
        if i in traced.batch_argnums:
            walk(arg, f"args[{i}]", first)
        first += arg.num_leaves
    return found


def sparse_refusal(who: str, num_microbatches: int, sparse: list[str]) -> ValueError:
    """The error for a batch that holds sparse arrays (``sparse``: :func:`sparse_batch_leaves`)."""
    return ValueError(
        f"{who}: the batch holds a sparse array ({', '.join(sparse[:3])}): autopp splits the batch's leaves along axis "
        f"0 into num_microbatches={num_microbatches} microbatches, but a sparse array's shape is static metadata its "
        "leaves (data, indices) do not carry, so a microbatch's part keeps the whole batch's shape. Pass its dense "
        "form (x.todense()), or its data and indices per example as arrays of the batch, building the sparse array "
        "inside the loss; or use num_microbatches=1 (data-parallel devices split it correctly). If it is not the "
        "batch (a fixed adjacency or mask passed last), name the batch's argument with batch_argnums.")


OVERWRITE_WITH_GRADIENT = "overwrite_with_gradient"  # (Flax's fp8 state collection: '_overwrite_with_gradient')


def refuse_overwritten_by_gradient(traced: TracedStep, num_microbatches: int, who: str = "autopp.parallelize") -> None:
    """Refuse, at more than one microbatch, a differentiated leaf of Flax's ``_overwrite_with_gradient`` collection
    (fp8 delayed scaling, ``flax.linen.Fp8DotGeneralOp``): its ``custom_vjp`` returns the leaf's new value (an amax
    history, a scale) as its "gradient", which the step stores; the microbatches' gradients are added up, so the
    stored state would be about ``num_microbatches`` times jit's, compounding step after step (trial QUANT: an amax
    history 16x jit's after two steps)."""
    if num_microbatches == 1:
        return
    outer = traced.jaxpr.jaxpr.invars
    names = [traced.leaf_paths[outer.index(a)] for a, d in zip(traced.grad_eqn.invars, traced.spec.diff_mask)
             if d and a in outer and OVERWRITE_WITH_GRADIENT in traced.leaf_paths[outer.index(a)]]
    if names:
        raise ValueError(
            f"{who}: {', '.join(names[:3])}{' ...' if len(names) > 3 else ''} belong(s) to Flax's "
            f"'_overwrite_with_gradient' collection (fp8 delayed scaling): its gradient is the state's new value (an "
            f"amax history, a scale), not a gradient, and the {num_microbatches} microbatches' gradients are added "
            "up, so the state the step stores would be about num_microbatches times plain jax.jit's, growing every "
            "step. Use num_microbatches=1 (a stage's data-parallel devices then compute over the whole batch), or "
            "keep the fp8 scales out of the differentiated parameters.")
    overwritten, transformed = backward_outputs(traced.spec.forward.jaxpr, traced.spec.diff_mask)

    def named(leaves):
        names = [traced.leaf_paths[outer.index(a)] if a in outer else traced.spec.input_name(k)
                 for k in leaves for a in [traced.grad_eqn.invars[k]]]
        return f"{', '.join(names[:3])}{' ...' if len(names) > 3 else ''}"

    for eqn, leaves in overwritten:
        raise ValueError(
            f"{who}: the backward of the jax.custom_vjp at {user_line(eqn)} returns, as the \"gradient\" of "
            f"{named(leaves)}, a value that does not depend on the cotangent: not a gradient but a new value the step "
            f"stores (fp8 delayed scaling's amax history or scale, \"overwrite with gradient\"). The {num_microbatches} "
            "microbatches' gradients are added up, so the stored value would be about num_microbatches times plain "
            "jax.jit's, growing every step. Use num_microbatches=1 (a stage's data-parallel devices then compute over "
            "the whole batch), or keep that state out of the differentiated parameters.")
    for eqn, leaves in transformed:
        warnings.warn(
            f"{who}: the backward of the jax.custom_vjp at {user_line(eqn)} returns, as the gradient of "
            f"{named(leaves)}, a value that is not linear in the cotangent (a clip, a normalisation, the cotangent's "
            "amax, a term added to it): each of the "
            f"{num_microbatches} microbatches' gradients is transformed on its own and they are added up, which "
            "differs from plain jax.jit's transform of the whole batch's gradient. Use num_microbatches=1 for jit's "
            "values, or transform the gradient in the step (optax) rather than in the backward.",
            stacklevel=user_stacklevel())


def refuse_leaves_without_rows(args: tuple, flat_with_paths, batch_mask, leaf_paths, batch_argnums, who: str) -> None:
    """Refuse batch leaves that are no arrays with a leading batch dimension (a scalar, a PRNG key, a Python value),
    naming them; where the batch is the step's last argument (the default), also the argument that looks like the
    batch: its array leaves all share one leading dimension (diffusers' ``train_step(unet, text, opt, batch, rng)``)."""
    bad = []
    for (path, leaf), is_batch, name in zip(flat_with_paths, batch_mask, leaf_paths):
        if is_batch and not isinstance(leaf, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)):
            bad.append(f"  {name}: {type(leaf).__name__} {leaf!r:.60}")
        elif is_batch and np.ndim(leaf) == 0 and not isinstance(leaf, jax.ShapeDtypeStruct):
            key = jax.dtypes.issubdtype(getattr(leaf, "dtype", None), jax.dtypes.prng_key)
            bad.append(f"  {name}: a {'PRNG key' if key else 'scalar'} has no batch dimension to split"
                       + (" (a step that draws its examples from it: draw them before the step and pass them in as "
                          "its batch)" if key else ""))
    if not bad:
        return
    if len(bad) > 8:
        bad = bad[:8] + [f"  ... and {len(bad) - 8} more"]
    rows = {}  # argument -> the one leading dimension of its leaves, for arguments before the last
    if tuple(batch_argnums) == (len(args) - 1,):
        for i, a in enumerate(args[:-1]):
            leaves = jax.tree_util.tree_leaves(a)
            if leaves and all(np.ndim(x) >= 1 for x in leaves) and len({np.shape(x)[0] for x in leaves}) == 1:
                rows[i] = np.shape(leaves[0])[0]
    last = max(rows, default=None)
    hint = (f" args[{len(args) - 1}] is the step's last argument, the batch when batch_argnums is not given; "
            f"args[{last}] looks like the batch (its leaves all have {rows[last]} rows): pass batch_argnums={last}."
            if last is not None else "")
    raise TypeError(
        f"{who}: every leaf of the batch argument(s) "
        f"{batch_argnums} must be an array with a leading batch dimension (jax.Array or numpy "
        "array); these are not:\n" + "\n".join(bad) + "\nMove values that are not per example (a count over the "
        "batch, a setting) to an argument of the step of their own, or set batch_argnums to the argument(s) "
        "holding only the batch; a list of per-example values becomes an array with jnp.asarray(...)." + hint
    )
