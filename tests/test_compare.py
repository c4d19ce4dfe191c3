"""``autopp compare``: measured rows on the 8 CPU devices, predicted rows for a cluster equal to the simulator's."""

import dataclasses
import json

import pytest

from autopp._cli import main
from autopp.models import GPTConfig

TINY = ["--layers", "1", "--hidden", "16", "--heads", "2", "--seq", "8", "--vocab", "32"]
SMALL = ["--layers", "4", "--hidden", "256", "--heads", "8", "--seq", "256", "--vocab", "1024"]


def test_compare_on_the_local_devices_measures_every_layout(capsys):
    assert main(["compare", *TINY, "--global-batch", "8", "--steps", "1", "--stages", "2",
                 "--microbatches", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["mode"] == "measured" and "8 cpu" in out["cluster"]
    rows = {r["name"]: r for r in out["rows"]}
    assert list(rows) == ["autopp", "data-parallel", "fsdp", "tensor-parallel"]
    assert rows["autopp"]["layout"].startswith("2 stages x (data 4)")
    assert rows["tensor-parallel"]["layout"] == "data 4 x tensor 2" and rows["fsdp"]["layout"] == "fsdp 8"
    ref = rows[out["reference"]]
    assert ref["speedup"] == 1.0 and min(r["step_time_s"] for n, r in rows.items() if n != "autopp") == \
        ref["step_time_s"]
    for r in rows.values():
        assert r["step_time_s"] > 0 and r["peak_memory_bytes"] > 0 and r["mfu"] is None  # CPU: no known peak
        # TFLOP/s per device from the step's FLOPs: the same count for every layout
        assert r["tflops_per_device"] * r["step_time_s"] == pytest.approx(
            ref["tflops_per_device"] * ref["step_time_s"], rel=1e-9)


@pytest.mark.filterwarnings("ignore:simulate. tp=.* splits none:UserWarning")  # (small models: tp leaves them whole)
def test_compare_for_a_cluster_prints_the_simulators_predictions(capsys, tmp_path):
    from autopp.planner import plan_model, simulate

    png = tmp_path / "compare.png"
    assert main(["compare", *SMALL, "--global-batch", "64", "--cluster", "2x8xH100", "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    for name in ("autopp", "data-parallel", "fsdp", "tensor-parallel"):
        assert f"\n{name} " in text
    assert "predicted; speedup vs" in text and png.stat().st_size > 10_000
    assert main(["compare", *SMALL, "--global-batch", "64", "--cluster", "2x8xH100", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    config = GPTConfig(layers=4, hidden=256, heads=8, seq=256, vocab=1024, dtype="bfloat16", param_dtype="float32")
    rows = {r["name"]: r for r in out["rows"]}
    plan = plan_model(config, "2x8xH100", global_batch=64)
    assert rows["autopp"]["step_time_s"] == plan.predicted.step_time_s
    for flag, name in ((plan.zero1, "ZeRO-1"), (plan.sequence_parallel, "sequence parallel")):
        assert (name in rows["autopp"]["layout"]) == flag, rows["autopp"]["layout"]
    from autopp._compare import describe_plan  # stages counted as `autopp show` counts them
    from autopp.core import get_schedule

    four = tuple(dataclasses.replace(plan.stages[0], index=i) for i in range(4))
    grid = get_schedule("interleaved-1f1b", 4, 2, virtual_stages=2).to_text()
    interleaved = dataclasses.replace(plan, stages=four, virtual_stages=2, schedule="interleaved-1f1b",
                                      num_microbatches=2, schedule_text=grid)
    assert describe_plan(interleaved).startswith("2 device groups (4 stages) x ("), describe_plan(interleaved)
    for name in ("data-parallel", "fsdp", "tensor-parallel"):
        kw = rows[name]["simulate_kwargs"]
        assert kw["pp"] == 1 and kw["tp"] * kw["dp"] == 16 and not kw["zero1"] and not kw["sequence_parallel"]
        est = simulate(config, "2x8xH100", **kw)
        assert (rows[name]["step_time_s"], rows[name]["tflops_per_device"], rows[name]["mfu"],
                rows[name]["peak_memory_bytes"]) == (est.step_time_s, est.tflops_per_gpu, est.mfu,
                                                     est.peak_memory_bytes_per_gpu)
    assert (rows["fsdp"]["simulate_kwargs"]["fsdp"], rows["data-parallel"]["simulate_kwargs"]["fsdp"]) == (16, 1)
    assert rows["tensor-parallel"]["simulate_kwargs"]["tp"] > 1
    best = min((r for n, r in rows.items() if n != "autopp" and r["fits"]), key=lambda r: r["step_time_s"])
    assert rows["autopp"]["speedup"] == pytest.approx(best["step_time_s"] / rows["autopp"]["step_time_s"])


@pytest.mark.parametrize("extra, message", [
    (["--cluster", "2x8xH100", "--steps", "3"], "--steps apply to --cluster local only"),
    (["--cluster", "2x8xH100", "--global-batch", "12"], "use a multiple of 16"),
    (["--global-batch", "8", "--batch-size", "4"], "disagree"),
    (["--step", "examples.planning_step:tiny", "--global-batch", "8"], "needs a target --cluster"),
    (["--cluster", "2x8xH100", "--step", "examples.planning_step"], "expected package.module:function"),
])
def test_compare_refuses_what_it_cannot_honour(capsys, extra, message):
    model = [] if "--step" in extra else SMALL
    assert main(["compare", *model, *extra] + ([] if "--global-batch" in extra else ["--global-batch", "64"])) == 2
    assert message in capsys.readouterr().err


@pytest.mark.filterwarnings("ignore:simulate. tp=.* splits none:UserWarning")  # (small models: tp leaves them whole)
def test_compare_predicts_a_llama_and_a_users_step_for_a_cluster(capsys, monkeypatch):
    import pathlib
    import sys

    from autopp.models import LlamaConfig
    from autopp.planner import plan_model, simulate
    from autopp.profiler import profile

    assert main(["compare", "--model", "llama", "--layers", "2", "--hidden", "256", "--heads", "8", "--kv-heads", "2",
                 "--ffn", "512", "--seq", "256", "--vocab", "1024", "--global-batch", "16", "--cluster", "1x8xH100",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    config = LlamaConfig(layers=2, hidden=256, heads=8, kv_heads=2, ffn=512, seq=256, vocab=1024, dtype="bfloat16",
                         param_dtype="float32")
    assert out["model"] == config.to_dict()
    rows = {r["name"]: r for r in out["rows"]}
    assert rows["autopp"]["step_time_s"] == plan_model(config, "1x8xH100", global_batch=16).predicted.step_time_s
    assert rows["tensor-parallel"]["step_time_s"] == simulate(
        config, "1x8xH100", **rows["tensor-parallel"]["simulate_kwargs"]).step_time_s

    # --step: the step's profile on the cluster's device, planned and simulated like a zoo model
    monkeypatch.chdir(pathlib.Path(__file__).resolve().parents[1])
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert main(["compare", "--step", "examples.planning_step:tiny", "--global-batch", "16", "--cluster",
                 "1x8xH100"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("step examples.planning_step:tiny (") and "predicted; speedup vs" in text
    from examples.planning_step import tiny

    step, args, batch_argnums = tiny()
    prof = profile(step, *args, cluster="1x8xH100", batch_argnums=batch_argnums)
    plan = plan_model(prof, "1x8xH100", global_batch=16)
    assert f"{plan.predicted.step_time_s * 1e3:.1f} ms" in text.split("\nautopp ")[1].split("\n")[0]
