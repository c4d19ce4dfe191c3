"""Every use of JAX internals lives here, so that a JAX upgrade touches one file.

Supported JAX range: ``>=0.10,<0.11`` (tested with 0.10.2).
"""

from __future__ import annotations

import jax
from jax.extend import core as jex_core
from jax.interpreters import mlir

SUPPORTED_JAX = (">=0.10", "<0.11")

# Primitives whose body is an ordinary call with no semantics of its own: inlined when tracing.
CALL_PRIMITIVE_NAMES = frozenset({"jit", "pjit", "closed_call", "core_call", "remat_call"})


def call_body(eqn) -> jex_core.ClosedJaxpr | None:
    """The called jaxpr of a plain call equation (``jit`` and friends), or None."""
    if eqn.primitive.name not in CALL_PRIMITIVE_NAMES:
        return None
    body = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    if body is None:
        return None
    if isinstance(body, jex_core.Jaxpr):
        body = jex_core.ClosedJaxpr(body, ())
    return body


def register_fallback_lowering(primitive, impl) -> None:
    """Lower ``primitive`` by tracing ``impl`` (so a traced step can still be jitted whole)."""
    mlir.register_lowering(primitive, mlir.lower_fun(impl, multiple_results=primitive.multiple_results))


def is_tracer(x) -> bool:
    return isinstance(x, jax.core.Tracer)


def new_jaxpr(constvars, invars, outvars, eqns, effects, name: str = "autopp") -> jex_core.Jaxpr:
    """A jaxpr over existing equations (a slice of another), with the debug info JAX expects."""
    info = jex_core.DebugInfo(name, name, tuple(f"in{i}" for i in range(len(invars))),
                              tuple(f"out{i}" for i in range(len(outvars))))
    return jex_core.Jaxpr(constvars, invars, outvars, eqns, effects, debug_info=info)
