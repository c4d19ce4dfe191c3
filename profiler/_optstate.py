"""Which optimizer-state leaves belong to which parameter, read off the step's update equations."""

from __future__ import annotations


from jax.extend import core as jex_core

from autopp.profiler._costs import aval_bytes

Literal = jex_core.Literal


def optimizer_state_owners(jaxpr: jex_core.Jaxpr, grad_index: int, param_of_grad_output: dict[int, int],
                           batch_mask, zeroed: dict | None = None) -> dict[int, int]:
    """Map step inputs (flat indices) that hold optimizer state to the forward input (parameter) they serve.

    Labels flow forward from each gradient output through the update equations (an equation takes the
    label of its largest labelled input), then backwards to unlabelled inputs of the same shape as a
    labelled result (Adam's ``mu`` in ``b1 * mu + (1 - b1) * g``). Scalars such as the step count stay
    unlabelled: they belong to no parameter. ``param_of_grad_output`` maps the gradient equation's output
    positions to forward-input indices; ``zeroed`` labels more variables the same way (the zeros standing for a
    frozen weight's gradient, :attr:`TracedStep.zeroed_gradients`).
    """
    grad = jaxpr.eqns[grad_index]
    label: dict = {}
    for pos, k in param_of_grad_output.items():
        label[grad.outvars[pos]] = k
    label.update(zeroed or {})
    post = [e for i, e in enumerate(jaxpr.eqns) if i != grad_index]
    for eqn in post:
        labelled = [a for a in eqn.invars if not isinstance(a, Literal) and a in label]
        if labelled:
            k = label[max(labelled, key=lambda v: aval_bytes(v.aval))]
            for v in eqn.outvars:
                label.setdefault(v, k)
    for eqn in reversed(post):
        outs = [v for v in eqn.outvars if v in label]
        if not outs:
            continue
        for a in eqn.invars:
            if isinstance(a, Literal) or a in label:
                continue
            same = [v for v in outs if v.aval.shape == a.aval.shape and a.aval.shape != ()]
            if same:
                label[a] = label[same[0]]
    return {i: label[v] for i, v in enumerate(jaxpr.invars) if v in label and not batch_mask[i]}
