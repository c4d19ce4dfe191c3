"""Multi-host runs on JAX's multi-controller runtime.

Every process runs the same program::

    import autopp.distributed
    autopp.distributed.initialize()          # before any other JAX call; arguments from the environment
    step = autopp.parallelize(train_step, num_stages=4, num_microbatches=4, schedule="1f1b")
    params, opt_state, loss = step(params, opt_state, batch)   # same host inputs on every process
    print(float(loss))                       # scalar outputs are on every process

Each process runs the stages whose devices are its own; transfers between stages on different processes are
cross-process ``jax.device_put``\\ s. Outputs held by another process are ``jax.Array``\\ s without local shards
(:func:`gather` fetches one). ``autopp launch -n N -- python train.py`` starts N local processes for development.
"""

from autopp._distributed import (DEFAULT_FAILURE_TIMEOUT_S, LOST_PROCESS_EXIT_CODE, gather, initialize,
                                 is_initialized, shutdown)
from autopp._launch import launch

__all__ = ["DEFAULT_FAILURE_TIMEOUT_S", "LOST_PROCESS_EXIT_CODE", "gather", "initialize", "is_initialized", "launch",
           "shutdown"]
