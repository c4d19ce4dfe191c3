"""The autopp command line: demo, simulate (profile is covered in test_profile.py)."""

import json

from autopp._cli import main


def test_demo_trains_and_loss_goes_down(capsys):
    assert main(["demo", "--devices", "4", "--stages", "2", "--microbatches", "2", "--steps", "4", "--batch-size", "8",
                 "--layers", "2", "--hidden", "32", "--heads", "2", "--seq", "16", "--vocab", "64"]) == 0
    out = capsys.readouterr().out
    assert "pipeline: 2 stage(s), 2 microbatch(es), schedule 1f1b" in out
    assert out.count("step ") >= 4 and "(down)" in out


def test_simulate_json_matches_python_api(capsys):
    from autopp.models import GPTConfig
    from autopp.planner import simulate

    args = ["simulate", "--layers", "4", "--hidden", "256", "--heads", "8", "--seq", "512", "--vocab", "1024",
            "--global-batch", "64", "--cluster", "2x8xA100-80GB", "--tp", "2", "--pp", "2", "--microbatch-size", "2",
            "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["layout"]["dp"] == 4
    est = simulate(GPTConfig(layers=4, hidden=256, heads=8, seq=512, vocab=1024, dtype="bfloat16"), "2x8xA100-80GB",
                   global_batch=64, tp=2, pp=2, dp=4, microbatch_size=2)
    assert out["predicted"]["step_time_s"] == est.step_time_s


def test_simulate_bad_layout_is_an_error(capsys):
    assert main(["simulate", "--layers", "4", "--hidden", "256", "--heads", "8", "--global-batch", "64",
                 "--cluster", "1x8xH100", "--tp", "3"]) == 2
    assert "tp" in capsys.readouterr().err


def test_show_prints_a_saved_plan(tmp_path, capsys):
    import jax

    import autopp
    from tests._helpers import make_optimizer, make_step, tiny_mlp

    model, tx = tiny_mlp(), make_optimizer()
    params = model.init(jax.random.key(0))
    plan = autopp.parallelize(make_step(model, tx), num_stages=2, num_microbatches=4,
                              devices=jax.devices()[:2]).plan_for(params, tx.init(params), model.batch(jax.random.key(1), 8))
    plan.to_json(tmp_path / "plan.json")
    assert main(["show", str(tmp_path / "plan.json")]) == 0
    out = capsys.readouterr().out
    assert "pipeline: 2 stage(s), 4 microbatch(es), schedule 1f1b" in out
    assert "rank 0 |" in out and "1B3" in out
    (tmp_path / "bad.json").write_text("{")
    assert main(["show", str(tmp_path / "bad.json")]) == 2
    assert "not valid JSON" in capsys.readouterr().err


PLAN_ARGS = ["plan", "--layers", "12", "--hidden", "2048", "--heads", "16", "--seq", "1024", "--vocab", "51200",
             "--global-batch", "32", "--cluster", "4x2xA100-40GB", "--override", "inter_node_bandwidth=1.25e9"]


def test_plan_writes_the_plan_model_plan_and_show_reads_it(tmp_path, capsys):
    from autopp.models import GPTConfig
    from autopp.planner import Plan, plan_model
    from autopp.profiler import Cluster

    path = tmp_path / "plan.json"
    assert main(PLAN_ARGS + ["--out", str(path)]) == 0
    out = capsys.readouterr().out
    assert "pipeline: 4 stage(s)" in out and "predicted: step" in out and f"written to {path}" in out
    saved = Plan.from_json(path)
    cluster = Cluster.parse("4x2xA100-40GB").with_device_overrides(inter_node_bandwidth=1.25e9)
    direct = plan_model(GPTConfig(layers=12, hidden=2048, heads=16, seq=1024, vocab=51200, dtype="bfloat16"), cluster,
                        global_batch=32)
    assert saved.stages == direct.stages and saved.predicted == direct.predicted
    assert main(["show", str(path)]) == 0
    shown = capsys.readouterr().out
    assert "predicted timeline" in shown and "group   3 |" in shown and "optimizer state" in shown


def test_plan_infeasible_is_an_error_that_says_why(capsys):
    assert main(["plan", "--layers", "96", "--hidden", "12288", "--heads", "96", "--seq", "2048", "--vocab", "51200",
                 "--global-batch", "8", "--cluster", "1x8xA100-40GB", "--microbatch-sizes", "1"]) == 2
    err = capsys.readouterr().err
    assert "least memory any option needs" in err and "It would fit with" in err
