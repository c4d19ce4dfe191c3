"""The measured timeline of a pipelined step: complete, consistent, exportable, and the step's results unchanged."""

import json
import re

import jax
import numpy as np
import pytest

import autopp
from autopp.runtime import run_with_timeline
from tests._helpers import gpt_case


@pytest.fixture(scope="module")
def traced_step():
    train_step, state, batch = gpt_case()
    step = autopp.parallelize(train_step, num_stages=4, num_microbatches=4, schedule="gpipe",
                              devices=jax.devices()[:4])
    exe = step.executable_for(*state, batch)
    flat = jax.tree.leaves((*state, batch))
    expected = jax.block_until_ready(exe.run(flat))
    outputs, timeline = run_with_timeline(exe, flat)
    return step, state, batch, exe, expected, outputs, timeline


def test_results_are_those_of_a_normal_step(traced_step):
    *_, expected, outputs, _ = traced_step
    jax.tree.map(np.testing.assert_array_equal, outputs, expected)


def test_every_action_once_and_each_group_runs_one_task_at_a_time(traced_step):
    step, state, batch, exe, *_, timeline = traced_step
    labels = [e.label for e in timeline.events]
    assert labels == [t.label for t in exe.tasks]
    for s in range(4):
        for m in range(4):
            assert labels.count(f"{s}F{m}") == 1
            assert labels.count(f"{s}B{m}") + labels.count(f"{s}F{m}+{s}B{m}") == 1
    by_lane = {}
    for e in timeline.events:
        assert 0 <= e.issued_s <= e.start_s <= e.end_s <= timeline.wall_s
        by_lane.setdefault(e.lane, []).append(e)
    for events in by_lane.values():
        for a, b in zip(events, events[1:]):
            assert b.start_s >= a.end_s
    assert {f"devices {d}" for d in range(4)} <= set(by_lane)
    # gpipe: the last stage's first forward cannot start before the first stage's first forward ended
    ev = {e.label: e for e in timeline.events}
    assert ev["3F0"].start_s >= ev["0F0"].end_s
    assert 0 < timeline.critical_path_s <= timeline.wall_s
    assert 0 <= timeline.bubble_fraction() < 1


def test_exports(traced_step, tmp_path):
    *_, timeline = traced_step
    trace = timeline.to_chrome_trace(tmp_path / "trace.json")
    loaded = json.loads((tmp_path / "trace.json").read_text())
    assert loaded == json.loads(json.dumps(trace))
    assert sum(e["ph"] == "X" for e in loaded["traceEvents"]) == len(timeline.events)
    timeline.plot(tmp_path / "timeline.png")
    assert (tmp_path / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_bad_output_path_is_refused_before_the_step_runs(tmp_path):
    """With donation the step consumes its inputs: a trace whose files cannot be written must not run it."""
    train_step, state, batch = gpt_case()
    step = autopp.parallelize(train_step, num_stages=2, num_microbatches=2, devices=jax.devices()[:2],
                              donate_argnums=(0, 1))
    state = jax.tree.map(lambda x: x + 0, state)  # our own copies, donated below
    for kw in ({"trace_json": tmp_path / "missing" / "t.json"}, {"gantt_png": tmp_path / "missing" / "g.png"}):
        with pytest.raises(ValueError, match="in a folder that does not exist .* Nothing was run"):
            step.trace(*state, batch, **kw)
    assert not any(x.is_deleted() for x in jax.tree.leaves(state))
    (*state, _), _ = step.trace(*state, batch, trace_json=tmp_path / "t.json")
    assert (tmp_path / "t.json").exists() and not any(x.is_deleted() for x in jax.tree.leaves(state))


def test_lanes_are_in_device_order(traced_step):
    """Lanes ordered by device (not by first use), the host last: the chart's rows follow the pipeline."""
    *_, timeline = traced_step
    lanes = timeline.lanes()
    groups = [lane for lane in lanes if re.fullmatch(r"devices \d+", lane)]  # (also "devices 0-3": the placing)
    assert groups == ["devices 0", "devices 1", "devices 2", "devices 3"], lanes
    assert "host" not in lanes or lanes[-1] == "host"
    from autopp.runtime._timeline import TaskEvent, Timeline

    first_use = ["host", "devices 10-11", "link to devices 2-3", "devices 2-3", "devices 0-1"]
    scrambled = Timeline(events=tuple(TaskEvent(label="0F0", lane=lane, start_s=0.0, end_s=1.0, issued_s=0.0)
                                      for lane in first_use), wall_s=1.0, issue_s=0.0, critical_path_s=1.0)
    assert scrambled.lanes() == ["devices 0-1", "devices 2-3", "link to devices 2-3", "devices 10-11", "host"]
    # printed as a one-line summary, not every event
    assert repr(scrambled) == ("Timeline(5 tasks on 5 lanes, wall 1000 ms, host issue 0 ms, critical path 1000 ms, "
                               f"bubble fraction {scrambled.bubble_fraction():.3f}; .events has every task)")
