"""What a loss's ``jax.custom_vjp`` backwards return for the differentiated inputs they take: a gradient is linear
in the cotangent, so the microbatches' gradients add up to the whole batch's. A backward that returns, for a
parameter it takes, a value independent of the cotangent (a state's new value: fp8 delayed scaling's amax history,
"overwrite with gradient") or one not linear in it (a clip, a normalisation, the cotangent's amax, a term added)
does not: added up over microbatches it differs from plain ``jax.jit``'s.

The backward is traced once per call (:func:`autopp.core.custom_vjp_backward`) and each of its values is classed
as zeros, independent of the cotangents, linear in them, or neither."""

from __future__ import annotations

import numpy as np
from jax.extend import core as jex_core

from autopp.core._compat import CALL_PRIMITIVE_NAMES, custom_vjp_backward

__all__ = ["backward_outputs"]

ZERO, CONST, LINEAR, OTHER = 0, 1, 2, 3
"""Classes of a backward's values: zeros; independent of the cotangents (not known to be zeros); linear in them;
neither (affine, or not linear)."""

_PASS_THROUGH = frozenset({"convert_element_type", "reshape", "squeeze", "expand_dims", "copy", "copy_p", "slice",
                           "dynamic_slice", "gather", "transpose"})  # (a layer's row of a stacked leaf)
# linear in their first operand where the others do not depend on the cotangents
_LINEAR_IN_FIRST = _PASS_THROUGH | {"neg", "broadcast_in_dim", "reduce_sum", "rev", "cumsum", "real", "imag", "conj",
                                    "reduce_precision", "pad", "sharding_constraint", "optimization_barrier", "split",
                                    "fft", "reduce_window_sum", "psum", "all_gather", "ppermute", "all_to_all",
                                    "reduce_scatter", "psum_scatter"}
_SUMS = frozenset({"add", "sub", "add_any", "concatenate", "complex"})
_PRODUCTS = frozenset({"mul", "dot_general", "conv_general_dilated"})
_CALLS = CALL_PRIMITIVE_NAMES | {"custom_jvp_call", "custom_vjp_call", "remat", "checkpoint"}
# linear in one operand (a right-hand side, a pooled window's cotangent) where the others do not depend on the
# cotangents: its position
_LINEAR_IN = {"triangular_solve": 1, "select_and_scatter_add": 0, "select_and_gather_add": 0}


def backward_outputs(forward, diff_mask) -> tuple[list, list]:
    """The ``jax.custom_vjp`` calls of the loss (``forward``, its differentiated inputs ``diff_mask``) that take a
    differentiated input as it is (cast, reshaped or sliced at most, also inside calls, scans, loops and branches),
    whose backward returns for it (1) a value that does not depend on the cotangents and is not zeros (Flax's fp8
    ``_overwrite_with_gradient`` written in plain JAX: trial QUANT's amax 3.977 for jit's 1.000 at 4 microbatches),
    or (2) one that is not linear in them (a gradient clipped in the backward). Two lists of ``(equation,
    [positions among forward's inputs])``."""
    found: list = []
    _leaf_calls(forward, {v: k for k, (v, d) in enumerate(zip(forward.invars, diff_mask)) if d}, found)
    overwritten, transformed = [], []
    for eqn, hit in found:
        backward = custom_vjp_backward(eqn)
        if backward is None:
            continue
        jaxpr = backward.jaxpr
        num_res = len(jaxpr.invars) - len(eqn.outvars)
        env = {v: (ZERO if np.all(np.asarray(c) == 0) else CONST) for v, c in zip(jaxpr.constvars, backward.consts)}
        env.update((v, CONST if k < num_res else LINEAR) for k, v in enumerate(jaxpr.invars))
        classes = _classify(jaxpr, env)
        by_class = {CONST: [], OTHER: []}
        for i, k in hit.items():
            by_class.get(classes[i], []).append(k)
        if by_class[CONST]:
            overwritten.append((eqn, by_class[CONST]))
        if by_class[OTHER]:
            transformed.append((eqn, by_class[OTHER]))
    return overwritten, transformed


def _leaf_calls(jaxpr, leaves: dict, found: list) -> None:
    """Walk ``jaxpr`` with ``leaves`` (variable -> position of the differentiated input it holds unchanged) and list
    each ``custom_vjp_call`` with ``{primal input index: position}`` of those it takes."""
    for eqn in jaxpr.eqns:
        ins = [None if isinstance(v, jex_core.Literal) else leaves.get(v) for v in eqn.invars]
        if not any(k is not None for k in ins):
            continue
        name = eqn.primitive.name
        if name == "custom_vjp_call":
            nc = eqn.params["num_consts"]
            found.append((eqn, {i - nc: k for i, k in enumerate(ins) if k is not None and i >= nc}))
            continue
        if name in _PASS_THROUGH:
            leaves[eqn.outvars[0]] = ins[0]
            continue
        # a call's, a scan's or remat's operands are its program's inputs; a branch's follow the index; a loop
        # body's, the test's constants
        offset = {"cond": 1, "while": eqn.params.get("cond_nconsts", 0)}.get(name, 0)
        for key, value in eqn.params.items():
            for sub in value if isinstance(value, tuple) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if (isinstance(inner, jex_core.Jaxpr) and offset + len(inner.invars) == len(ins)
                        and (name != "while" or key == "body_jaxpr")):
                    _leaf_calls(inner, {v: k for v, k in zip(inner.invars, ins[offset:]) if k is not None}, found)


def _classify(jaxpr, env: dict) -> list[int]:
    """The class of each output of ``jaxpr`` from its inputs' (``env``: variable -> class)."""
    def of(v):
        if isinstance(v, jex_core.Literal):
            return ZERO if np.all(np.asarray(v.val) == 0) else CONST
        return env.get(v, CONST)

    for eqn in jaxpr.eqns:
        ins = [of(v) for v in eqn.invars]
        env.update((v, c) for v, c in zip(eqn.outvars, _rule(eqn, ins)))
    return [of(v) for v in jaxpr.outvars]


def _rule(eqn, ins: list[int]) -> list[int]:
    name, n = eqn.primitive.name, len(eqn.outvars)
    top = max(ins, default=ZERO)
    if top <= CONST:
        zero = name in _LINEAR_IN_FIRST | _PRODUCTS | {"select_n"} and ins and (
            ins[0] == ZERO if name in _LINEAR_IN_FIRST else
            ZERO in ins if name in _PRODUCTS else all(c == ZERO for c in ins[1:]))
        return [ZERO if zero else CONST] * n
    if top == OTHER:
        return [OTHER] * n
    if name in _SUMS:  # a term independent of the cotangent added to one linear in it: affine
        return [LINEAR if all(c in (ZERO, LINEAR) for c in ins) else OTHER] * n
    if name in _PRODUCTS:
        return [LINEAR if ins.count(LINEAR) == 1 else OTHER] * n
    if name == "div":
        return [LINEAR if ins == [LINEAR, CONST] else OTHER] * n
    if name == "select_n":  # a choice by a test of the residuals between cases linear in it (or zeros)
        return [LINEAR if ins[0] <= CONST and all(c in (ZERO, LINEAR) for c in ins[1:]) else OTHER] * n
    if name in ("dynamic_update_slice", "scatter-add", "scatter_add"):  # linear in the operand and the update
        data, index = (ins[:2], ins[2:]) if name == "dynamic_update_slice" else ([ins[0], *ins[2:]], ins[1:2])
        return [LINEAR if all(c in (ZERO, LINEAR) for c in data) and all(c <= CONST for c in index) else OTHER] * n
    if name in _LINEAR_IN_FIRST:
        return [LINEAR if ins[0] == LINEAR and all(c <= CONST for c in ins[1:])
                and (name != "pad" or ins[1] == ZERO) else OTHER] * n
    if name in _LINEAR_IN:
        k = _LINEAR_IN[name]
        return [LINEAR if ins[k] == LINEAR and all(c <= CONST for j, c in enumerate(ins) if j != k) else OTHER] * n
    if name == "custom_linear_solve":  # (jnp.linalg.solve) linear in the right-hand side for a fixed matrix
        num_consts = sum(eqn.params["const_lengths"])
        return [LINEAR if all(c <= CONST for c in ins[:num_consts])
                and all(c in (ZERO, LINEAR) for c in ins[num_consts:]) else OTHER] * n
    if name in ("scan", "while"):
        return _loop(eqn, ins)
    if name == "cond" and ins[0] <= CONST:  # a branch chosen by the residuals: each branch's class, the worst
        per_branch = [_classify(b.jaxpr, dict(zip(b.jaxpr.invars, ins[1:]))) for b in eqn.params["branches"]]
        return [_join(cs) for cs in zip(*per_branch)]
    if name in _CALLS:
        inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
        inner = getattr(inner, "jaxpr", inner)
        if isinstance(inner, jex_core.Jaxpr) and len(inner.invars) == len(ins):
            return _classify(inner, dict(zip(inner.invars, ins)))
    return [OTHER] * n


def _join(classes) -> int:
    """The class of a value that is one of ``classes`` (a branch's): linear only where no branch adds a term."""
    if OTHER in classes or LINEAR in classes and CONST in classes:
        return OTHER
    return max(classes)


def _loop(eqn, ins: list[int]) -> list[int]:
    """A scan's or a while loop's outputs' classes: its carry's, iterated until they settle (a Neumann series or a
    scanned recurrence of the cotangent is linear in it; a loop whose number of iterations reads the cotangent is
    not)."""
    p = eqn.params
    if eqn.primitive.name == "scan":
        body, nc, ncar = p["jaxpr"].jaxpr, p["num_consts"], p["num_carry"]
        consts, carry, rest = ins[:nc], ins[nc:nc + ncar], ins[nc + ncar:]
    else:
        body, cn = p["body_jaxpr"].jaxpr, p["cond_nconsts"]
        nc = p["body_nconsts"]
        consts, carry, rest = ins[cn:cn + nc], ins[cn + nc:], []
    out = carry
    for _ in range(6):
        out = _classify(body, dict(zip(body.invars, consts + carry + rest)))
        settled = [_join((a, b)) for a, b in zip(carry, out[:len(carry)])]
        if settled == carry:
            break
        carry = settled
    else:
        return [OTHER] * len(eqn.outvars)
    if eqn.primitive.name == "while":
        cond = p["cond_jaxpr"].jaxpr
        if max(_classify(cond, dict(zip(cond.invars, ins[:cn] + carry))), default=ZERO) > CONST:
            return [OTHER] * len(eqn.outvars)
        return carry
    return carry + out[len(carry):]
