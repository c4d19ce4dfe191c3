"""One process of benchmarks/bench_multihost.py (started by ``autopp launch -n 2 --devices-per-process 4``).

Writes ``OUT/multihost.<process>.json``: cross-process transfer throughput (process 0's 4 devices -> process 1's,
activation-like arrays sharded over the batch) and the median step time of the zoo GPT as 4 stages with 1F1B.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import autopp.distributed
import jax

SIZES_MB = (1, 8, 64)
STEPS = 12


def main(out_dir: str) -> None:
    autopp.distributed.initialize()
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_multihost import bench_case, bench_plan

    from autopp.runtime._multiprocess import _cross_put, _empty, _Leg, mirror

    me = jax.process_index()
    devs = jax.devices()
    src = NamedSharding(Mesh(np.array(devs[:4]), ("data",)), P("data"))
    dst = NamedSharding(Mesh(np.array(devs[4:8]), ("data",)), P("data"))
    result: dict = {"transfer_mb_s": {}}
    for mb in SIZES_MB:
        shape = (mb * 2**20 // 4 // 1024, 1024)
        aval = jax.ShapeDtypeStruct(shape, np.float32)
        send, recv = mirror(src, dst)
        leg = _Leg(0, 0, 1, send, recv, dst, _empty(aval, send) if me != 0 else None)
        put = _cross_put([leg], me)
        host = np.ones(shape, np.float32)
        reps = max(4, 64 // mb)
        arrivals = []
        for _ in range(reps + 1):
            # No barrier: a barrier (sync_global_devices) between making an array and sending it was seen to
            # hang the transfer. The receiver times arrivals; the first opens the connection and is not counted.
            x = jax.device_put(host, src) if me == 0 else None
            (y,) = put(x)
            y.block_until_ready()
            arrivals.append(time.perf_counter())
        dt = arrivals[-1] - arrivals[0]
        if me == 1:
            result["transfer_mb_s"][str(mb)] = mb * reps / dt

    step_fn, state, batch = bench_case()
    step = autopp.parallelize(step_fn, **bench_plan(devs))
    times = []
    for _ in range(STEPS):
        t = time.perf_counter()
        *state, loss = step(*state, batch)
        float(loss)  # on every process: waits for the whole step
        times.append(time.perf_counter() - t)
    result["step_s"] = statistics.median(times[2:])
    result["loss"] = float(loss)
    with open(os.path.join(out_dir, f"multihost.{me}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
