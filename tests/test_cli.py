"""The autopp command line: demo, simulate, plan, show, --model llama and --step (profile is covered in
test_profile.py)."""

import json
import pathlib
import sys

import pytest

from autopp._cli import main

ROOT = pathlib.Path(__file__).resolve().parents[1]


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
    # the CLI's defaults: bfloat16 compute, float32 parameters (mixed precision)
    est = simulate(GPTConfig(layers=4, hidden=256, heads=8, seq=512, vocab=1024, dtype="bfloat16",
                             param_dtype="float32"), "2x8xA100-80GB", global_batch=64, tp=2, pp=2, dp=4,
                   microbatch_size=2)
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
    direct = plan_model(GPTConfig(layers=12, hidden=2048, heads=16, seq=1024, vocab=51200, dtype="bfloat16",
                                  param_dtype="float32"), cluster, global_batch=32)
    assert saved.stages == direct.stages and saved.predicted == direct.predicted
    assert main(["show", str(path)]) == 0
    shown = capsys.readouterr().out
    assert "predicted timeline" in shown and "group   3 |" in shown and "optimizer state" in shown
    assert "\n  block 0-11: blocks[*]: " in shown and "sharding ILPs" in shown


def test_plan_infeasible_is_an_error_that_says_why(capsys):
    assert main(["plan", "--layers", "96", "--hidden", "12288", "--heads", "96", "--seq", "2048", "--vocab", "51200",
                 "--global-batch", "8", "--cluster", "1x8xA100-40GB", "--microbatch-sizes", "1"]) == 2
    err = capsys.readouterr().err
    assert "least memory any option needs" in err and "It would fit with" in err


LLAMA = ["--model", "llama", "--layers", "2", "--hidden", "256", "--heads", "8", "--kv-heads", "2", "--ffn", "512",
         "--seq", "256", "--vocab", "1024"]


def _same_plan(a, b):
    assert a.stages == b.stages and a.predicted == b.predicted and a.layer_shardings == b.layer_shardings
    assert (a.schedule, a.num_microbatches, a.zero1, a.sequence_parallel, a.model_fingerprint) == \
        (b.schedule, b.num_microbatches, b.zero1, b.sequence_parallel, b.model_fingerprint)


def test_plan_llama_is_plan_model_of_the_llama_config(capsys):
    from autopp.models import LlamaConfig
    from autopp.planner import Plan, plan_model

    args = ["plan", *LLAMA, "--global-batch", "16", "--cluster", "1x8xH100", "--tensor-degrees", "2"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out.startswith("llama {'layers': 2, 'hidden': 256, 'heads': 8, 'kv_heads': 2, 'ffn': 512")
    assert "'dtype': 'bfloat16', 'param_dtype': 'float32'" in out and "predicted: step" in out
    assert main(args + ["--json"]) == 0
    saved = Plan.from_json(capsys.readouterr().out)
    config = LlamaConfig(layers=2, hidden=256, heads=8, kv_heads=2, ffn=512, seq=256, vocab=1024, dtype="bfloat16",
                         param_dtype="float32")
    _same_plan(saved, plan_model(config, "1x8xH100", global_batch=16, tensor_degrees=(2,)))
    assert saved.stages[0].mesh_shape["tensor"] == 2


def test_llama_flags_need_the_llama_model(capsys):
    assert main(["plan", "--kv-heads", "2", "--global-batch", "8", "--cluster", "1x8xH100"]) == 2
    assert "--kv-heads describe a Llama; add --model llama" in capsys.readouterr().err


def test_an_empty_cluster_is_refused_not_read_as_the_local_devices(capsys):
    """``--cluster "$CLUSTER"`` with the variable unset planned for the local CPU devices, silently (a user trial);
    the Python API refuses the empty string, and so does the command now."""
    assert main(["plan", "--global-batch", "8", "--cluster", ""]) == 2
    assert "empty cluster string" in capsys.readouterr().err


@pytest.fixture
def repo_root(monkeypatch):
    """Run in the repository root (as `autopp plan --step examples.planning_step:...` would), sys.path restored."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(ROOT))])
    for name in ("examples", "examples.planning_step"):  # imported afresh, from the current directory
        monkeypatch.delitem(sys.modules, name, raising=False)


def test_profile_step_says_its_batch_and_refuses_a_zoo_batch_size(repo_root, capsys):
    """``profile --step`` profiles the step at the batch its function returns and says so; ``--batch-size`` (a zoo
    model's) is refused rather than ignored, as it used to be."""
    assert main(["profile", "--step", "examples.planning_step:tiny", "--cluster", "1x8xH100"]) == 0
    import jax

    from examples.planning_step import tiny

    batch = jax.tree.leaves(tiny()[1][-1])[0].shape[0]
    assert capsys.readouterr().out.startswith(f"step examples.planning_step:tiny (traced at batch {batch})")
    assert main(["profile", "--step", "examples.planning_step:tiny", "--cluster", "1x8xH100",
                 "--batch-size", "8"]) == 2
    assert "drop --batch-size" in capsys.readouterr().err


def test_plan_step_is_plan_model_of_the_steps_profile(repo_root, tmp_path, capsys):
    from autopp.planner import Plan, plan_model
    from autopp.profiler import profile

    path = tmp_path / "plan.json"
    assert main(["plan", "--step", "examples.planning_step:tiny", "--global-batch", "16", "--cluster", "1x8xH100",
                 "--tensor-degrees", "2", "--out", str(path)]) == 0
    out = capsys.readouterr().out
    from examples.planning_step import tiny  # importable now: --step put the current directory on the path

    assert out.startswith("step examples.planning_step:tiny (") and "traced at batch 1" in out
    assert "pipeline:" in out and f"written to {path}" in out
    step, args, batch_argnums = tiny()
    prof = profile(step, *args, cluster="1x8xH100", batch_argnums=batch_argnums)
    _same_plan(Plan.from_json(path), plan_model(prof, "1x8xH100", global_batch=16, tensor_degrees=(2,)))
    assert Plan.from_json(path).loss_reduction == "mean"
    summed = tmp_path / "summed.json"
    assert main(["plan", "--step", "examples.planning_step:tiny", "--global-batch", "16", "--cluster", "1x8xH100",
                 "--tensor-degrees", "2", "--loss-reduction", "sum", "--out", str(summed)]) == 0
    assert Plan.from_json(summed).loss_reduction == "sum"
    capsys.readouterr()

    # show: after the plan and its timeline, one line per distinct layer sharding and the planner statistics
    assert main(["show", str(path)]) == 0
    shown = capsys.readouterr().out
    lines = shown.splitlines()
    at = next(i for i, l in enumerate(lines) if l.startswith("layer sharding (6 layers, 3 distinct; tensor axis of 2"))
    assert lines[at + 1].startswith("  embed: ")
    block = lines[at + 2]  # the four blocks are one program: one line (what the ILP chose is its business)
    assert block.startswith("  block 0-3: blocks[*]: ") and " wq" in block and " w_down" in block
    assert "| forward: " in block and "| backward: " in block
    assert lines[at + 3].startswith("  head: ")
    stats = "\n".join(lines[at + 4:])
    assert stats.startswith("planner statistics:") and "layouts evaluated" in stats
    assert "sharding ILPs" in stats and "solves in" in stats and "largest gap" in stats
    assert main(["show", str(path), "--grid"]) == 0
    assert "schedule:" in capsys.readouterr().out


def test_show_groups_identical_layer_shardings(tmp_path, capsys):
    import dataclasses

    from autopp.planner import LayerSharding, Plan

    plan = Plan.from_json(json.dumps(json.loads(SAVED_PLAN)))

    def block(i, wq="S(1)", comm=True):
        p = f"args[0]['blocks'][{i}]"
        return LayerSharding(index=i + 1, name=f"block {i}", params={
            f"{p}['attn']['wq']": wq, f"{p}['attn']['wo']": "S(0)", f"{p}['norm']['scale']": "R"},
            collectives=[["all-reduce", 3 * 2**20, 2e-4, "forward"], ["all-gather", 2**20, 1e-4, "forward"],
                         ["all-reduce", 4 * 2**20, 3e-4, "backward"]] if comm else [])

    shardings = (LayerSharding(index=0, name="embed", params={"args[0]['embed']": "S(1)"},
                               collectives=[["all-to-all", 2048, 5e-6, "backward"]]),
                 *(block(i) for i in range(3)), block(3, wq="R", comm=False), block(4), block(5),
                 LayerSharding(index=7, name="head", params={"args[0]['lm_head']": "R"}, collectives=[]))
    path = tmp_path / "plan.json"
    dataclasses.replace(plan, layer_shardings=shardings).to_json(path)
    assert main(["show", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    at = next(i for i, l in enumerate(lines) if l.startswith("layer sharding (8 layers, 4 distinct; tensor axis of 1"))
    assert lines[at + 1:at + 5] == [
        "  embed: S(1) embed | forward: none | backward: 1 all-to-all, 2.0 KiB, 5 us",
        "  block 0-2, block 4-5: blocks[*]: S(0) attn.wo, S(1) attn.wq, R norm.scale | forward: 1 all-reduce + "
        "1 all-gather, 4.0 MiB, 300 us | backward: 1 all-reduce, 4.0 MiB, 300 us",
        "  block 3: blocks[3]: S(0) attn.wo, R attn.wq norm.scale | forward: none | backward: none",
        "  head: R lm_head | forward: none | backward: none",
    ]


SAVED_PLAN = json.dumps({
    "schema_version": 3, "model_fingerprint": "x", "num_microbatches": 2, "microbatch_size": 1, "schedule": "1f1b",
    "virtual_stages": 1, "schedule_text": "0F0 0B0 0F1 0B1", "loss_reduction": "mean", "cluster": None,
    "predicted": None, "planner": None, "zero1": False, "sequence_parallel": False, "layer_shardings": [],
    "stages": [{"index": 0, "devices": [0], "mesh_shape": {"data": 1}, "equations": None, "num_equations": None,
                "flops": 1.0, "param_bytes": 1, "cut_bytes_after": 0}]})


@pytest.mark.filterwarnings("ignore:simulate. tp=.* splits none:UserWarning")  # (small models: tp leaves them whole)
def test_simulate_step_is_simulate_of_the_steps_profile(repo_root, capsys):
    from autopp.planner import simulate
    from autopp.profiler import profile

    assert main(["simulate", "--step", "examples.planning_step:tiny", "--global-batch", "16", "--cluster",
                 "2x8xA100-80GB", "--tp", "2", "--pp", "2", "--microbatch-size", "2", "--zero1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    from examples.planning_step import tiny

    assert out["model"]["step"] == "examples.planning_step:tiny" and out["layout"]["dp"] == 4
    step, args, batch_argnums = tiny()
    prof = profile(step, *args, cluster="2x8xA100-80GB", batch_argnums=batch_argnums)
    est = simulate(prof, "2x8xA100-80GB", global_batch=16, tp=2, pp=2, dp=4, microbatch_size=2, zero1=True)
    assert out["predicted"] == est.to_dict()
    assert main(["simulate", "--step", "examples.planning_step:tiny", "--global-batch", "16", "--cluster",
                 "1x8xH100", "--tp", "2"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("step examples.planning_step:tiny") and "layout: tp 2 x pp 1 x dp 4" in text


BAD_STEPS = '''
import jax

def step(params, batch):
    return params

def not_a_tuple():
    return 42

def one():
    return (step,)

def args_not_a_tuple():
    return step, {"w": jax.ShapeDtypeStruct((2,), "float32")}

def step_not_callable():
    return 1, (jax.ShapeDtypeStruct((2,), "float32"),)

def bad_argnums():
    return step, (jax.ShapeDtypeStruct((2,), "float32"),), "batch"

def needs_args(size):
    return step, ()

def raises():
    raise ValueError("no such checkpoint")

value = 3
'''


@pytest.mark.parametrize("spec, message", [
    ("examples.planning_step", "expected package.module:function"),
    ("examples.planning_step:", "expected package.module:function"),
    (":tiny", "expected package.module:function"),
    ("examples/planning_step.py:tiny", "is a file path; name the module as Python imports it, e.g. --step "
                                       "examples.planning_step:tiny"),
    ("no_such_package.steps:tiny", "no module named 'no_such_package.steps' in the current directory"),
    ("examples.planning_step:llama_7b", "module 'examples.planning_step' has no attribute 'llama_7b'; its functions:"),
    ("bad_steps:value", "bad_steps.value is int 3, not a function"),
    ("bad_steps:needs_args", "needs arguments, but --step calls it with none"),
    ("bad_steps:not_a_tuple", "returned int 42; expected (step, args) or (step, args, batch_argnums)"),
    ("bad_steps:one", "returned a 1-tuple; expected (step, args)"),
    ("bad_steps:args_not_a_tuple", "(the step's arguments) is dict {'w': ShapeDtypeStruct"),
    ("bad_steps:step_not_callable", "(the step) is int 1, not a function"),
    ("bad_steps:bad_argnums", "batch_argnums 'batch'"),
    ("bad_steps:raises", "bad_steps.raises() raised ValueError: no such checkpoint"),
])
def test_bad_step_is_an_error_naming_it(repo_root, tmp_path, monkeypatch, capsys, spec, message):
    (tmp_path / "bad_steps.py").write_text(BAD_STEPS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "bad_steps", raising=False)
    assert main(["plan", "--step", spec, "--global-batch", "8", "--cluster", "1x8xH100"]) == 2
    err = capsys.readouterr().err
    assert f"--step {spec!r}" in err and message in err, err


def test_an_error_in_the_user_s_own_code_says_where(tmp_path, monkeypatch, capsys):
    """An error raised by the user's loss while autopp traces it names the file and line it came from (it used to
    be one line with no location); autopp's own checks keep their message alone."""
    (tmp_path / "broken_steps.py").write_text(
        "import jax, autopp\n"
        "def loss(w, batch):\n"
        "    x, y, z = batch\n"
        "    return ((x @ w - y) ** 2).mean()\n"
        "def step(w, batch):\n"
        "    value, grad = autopp.value_and_grad(loss)(w, batch)\n"
        "    return w - 0.1 * grad, value\n"
        "def broken():\n"
        "    sds = jax.ShapeDtypeStruct\n"
        "    return step, (sds((4, 2), 'float32'), (sds((8, 4), 'float32'), sds((8, 2), 'float32')))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "broken_steps", raising=False)
    assert main(["plan", "--step", "broken_steps:broken", "--global-batch", "8", "--cluster", "1x8xH100"]) == 2
    err = capsys.readouterr().err
    assert f"raised at {tmp_path / 'broken_steps.py'}:3 in loss; AUTOPP_DEBUG=1" in err, err
    assert main(["plan", "--model", "gpt", "--global-batch", "8", "--cluster", "1x8xH1000"]) == 2
    assert "raised at" not in capsys.readouterr().err


def test_step_imports_from_the_current_directory(tmp_path, monkeypatch, capsys):
    (tmp_path / "bad_steps.py").write_text(BAD_STEPS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "bad_steps", raising=False)
    assert main(["simulate", "--step", "bad_steps:one", "--global-batch", "8", "--cluster", "1x8xH100"]) == 2
    assert "returned a 1-tuple" in capsys.readouterr().err  # imported: the module was found


def test_step_excludes_the_zoo_flags(capsys):
    assert main(["plan", "--step", "examples.planning_step:tiny", "--layers", "2", "--dtype", "float32",
                 "--global-batch", "8", "--cluster", "1x8xH100"]) == 2
    assert "--layers, --dtype describe a zoo model (--model)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", "--step", "examples.planning_step:tiny", "--model", "gpt", "--global-batch", "8",
              "--cluster", "1x8xH100"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_compare_is_listed_with_its_own_help_without_being_imported():
    """``autopp --help`` lists ``compare`` from a stub (its module imports JAX); the line is ``compare``'s own."""
    import argparse

    from autopp import _cli, _compare

    sub = argparse.ArgumentParser().add_subparsers()
    _compare.add_parser(sub, _cli._add_model_flags, _cli._positive)
    (action,) = [a for a in sub._choices_actions if a.dest == "compare"]
    assert action.help == _cli._COMPARE_HELP
    assert _cli._subcommand(["--help"]) is None and _cli._subcommand(["compare", "--steps", "2"]) == "compare"


@pytest.mark.parametrize("flags, message", [
    (["--global-batch", "13", "--pipeline-degrees", "1", "--tensor-degrees", "1"],
     "global_batch=13 is not divisible by any data-parallel degree the layouts allow ([8]); use a global batch that "
     "is a multiple of one of them (e.g. 8)"),
    (["--global-batch", "16", "--tensor-degrees", "3"], "no tensor degree in tensor_degrees divides a node's 8"),
    (["--global-batch", "16", "--pipeline-degrees", "64"], "no pipeline degree (pipeline_degrees=(64,), at most"),
    (["--global-batch", "16", "--microbatch-sizes", "3"], "no microbatch size in microbatch_sizes=(3,) divides"),
    (["--global-batch", "16", "--time-limit", "0"], "time_limit_s must be a positive number of seconds"),
])
def test_plan_with_no_layout_to_try_says_which_restriction(capsys, flags, message):
    """Divisibility and the restrictions given, not memory ("needs inf GiB ... more nodes"), when nothing is tried."""
    assert main(["plan", "--layers", "4", "--hidden", "256", "--heads", "8", "--seq", "128", "--vocab", "1024",
                 "--cluster", "1x8xH100", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "inf GiB" not in err, err


def test_plan_out_in_a_missing_folder_fails_before_planning(tmp_path, capsys, monkeypatch):
    import autopp.planner

    monkeypatch.setattr(autopp.planner, "plan_model", lambda *a, **k: pytest.fail("planned before checking --out"))
    out = tmp_path / "missing" / "plan.json"
    assert main(["plan", "--layers", "2", "--hidden", "64", "--heads", "4", "--global-batch", "8",
                 "--cluster", "1x8xH100", "--out", str(out)]) == 2
    assert f"--out {out}: the folder" in capsys.readouterr().err


def test_unknown_device_suggests_the_kinds_it_begins(capsys):
    assert main(["simulate", "--layers", "4", "--hidden", "256", "--heads", "8", "--global-batch", "64",
                 "--cluster", "1x8xA100"]) == 2
    assert "Did you mean 'A100-40GB' or 'A100-80GB'?" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["launch", "-n", "2", "--", "/nonexistent/program"], "cannot run '/nonexistent/program': no such program"),
    (["launch", "-n", "2", "--port", "99999", "--", sys.executable], "--port 99999; give a TCP port"),
])
def test_launch_refuses_what_it_cannot_start(capsys, argv, message):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_a_count_that_is_not_a_number_is_named_as_such(capsys):
    with pytest.raises(SystemExit):
        main(["launch", "-n", "x", "--", sys.executable])
    assert "-n/--num-processes: must be a positive integer, got 'x'" in capsys.readouterr().err


def test_python_dash_m_autopp_is_the_command_line():
    """``python -m autopp`` runs the same command line as the ``autopp`` script (a user trial found it missing)."""
    import os
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-m", "autopp", "--help"], capture_output=True, text=True, cwd=root,
                         env={**os.environ, "PYTHONPATH": root}, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "usage: autopp" in out.stdout and "plan" in out.stdout
