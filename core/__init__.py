"""autopp's core: what every other part builds on (nothing here imports profiler, planner, runtime or the public
face). JAX compatibility (the only user of ``jax._src``), the gradient marker, tracing, the jaxpr toolkit, the
schedule IR, per-stage programs, and the plan and estimate types."""

from autopp.core._compat import (
    CALL_PRIMITIVE_NAMES,
    FUSED_ATTENTION_SCOPE,
    InternalFloatingPointError,
    SUPPORTED_JAX,
    bind_eqn,
    call_body,
    copy_shards,
    device_free_key,
    device_list,
    distributed_client,
    is_local,
    is_tracer,
    lowered_devices,
    map_sharding,
    marking_fused_attention,
    name_stack,
    new_jaxpr,
    prng_impl,
    register_fallback_lowering,
    remat_refuses,
    retarget,
    serialize_compiled,
    same_shard_positions,
    user_line,
    weak_typed,
)
from autopp.core._grad import GradSpec, grad, marking_gradients, value_and_grad, value_and_grad_p
from autopp.core._jaxpr import (
    batch_dependent_vars,
    constant_outputs,
    differentiable_vars,
    eqn_signature,
    eval_closed,
    forward_with_vjp,
    inner_jaxpr,
    eval_jaxpr_with,
    literal_signature,
    scale_batch_independent_terms,
    slice_jaxpr,
    structure_signature,
    warn_unrecomputable,
    without_host_prints,
)
from autopp.core._trace import (
    TracedStep,
    abstract_leaf,
    check_array_leaves,
    check_gradient_not_split,
    is_weak,
    normalize_batch_argnums,
    outside_the_context_mesh,
    trace_microbatch_forward,
    trace_step,
)
from autopp.core._batch_split import (
    check_batch_divisible,
    refuse_overwritten_by_gradient,
    sparse_batch_leaves,
    sparse_leaf_mask,
)
from autopp.core._row_layout import block_copies_met
from autopp.core._warn import user_stacklevel
from autopp.core._schedule import KINDS, Action, Schedule, ScheduleError, dependencies, validate
from autopp.core._schedule_sim import bubble_fraction, dispatch_order, simulate_ticks, simulate_times
from autopp.core._schedules import (
    SCHEDULE_NAMES,
    dualpipe_v,
    get_schedule,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    zb_h1,
)
from autopp.core._estimate import (
    DEFAULT_OVERLAP,
    OVERLAPS,
    RECOMPUTE_MODES,
    SCHEDULES,
    Estimate,
    divisors,
    positive_int,
    unit,
)
from autopp.core._plan import (
    MESH_AXES,
    READABLE_SCHEMA_VERSIONS,
    SCHEMA_VERSION,
    LayerSharding,
    Plan,
    PlannerStats,
    StagePlan,
    id_ranges,
    split_summary,
)
from autopp.core._mixing import CALLBACK
from autopp.core._reduction import (FIRST, ORDER, PAIRS, SPREAD, STRUCTURE, mixing_by_output, mixing_summary,
                                    output_reductions)
from autopp.core._remat import layer_checkpointed
from autopp.core._reroll import ScanRun, find_scan_runs, read_rows, reroll_scans, row_slice
from autopp.core._stage import RECOMPUTE_POLICIES, StageGraph, StagePrograms, stage_graphs
from autopp.core._hoist import MOVED_WORK_SCOPE, is_heavy, moved_work_inputs
from autopp.core._twins import DeviceMapped, twin_program

__all__ = [name for name in dir() if not name.startswith("_")]
