"""The measured timeline of a pipelined step: complete, consistent, exportable, and the step's results unchanged."""

import json
import re

import jax
import numpy as np
import pytest

import autopp
from autopp.runtime import run_with_timeline
from tests._helpers import gpt_case


def _built(num_stages, schedule):
    """(step, state, batch, executable, flat inputs, the outputs of one normal step) of the tiny GPT."""
    train_step, state, batch = gpt_case()
    step = autopp.parallelize(train_step, num_stages=num_stages, num_microbatches=4, schedule=schedule,
                              devices=jax.devices()[:num_stages])
    exe = step.executable_for(*state, batch)
    flat = jax.tree.leaves((*state, batch))
    return step, state, batch, exe, flat, jax.block_until_ready(exe.run(flat))


@pytest.fixture(scope="module")
def traced_step():
    step, state, batch, exe, flat, expected = _built(4, "gpipe")
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


def test_a_task_whose_outputs_a_later_task_donates_is_waited_for(monkeypatch):
    """An accumulating backward hands its gradient buffers to the next one (donates them): once that is issued, the
    first one's outputs can no longer be waited on. The watcher used to catch the error and stamp the task done at
    that moment: in a user trial 7 of 8 backwards of a 2-stage 1F1B step lasted 0.03-0.28 ms on the timeline, against
    12 ms timed alone. Now such a task is watched through a probe (one element of each shard, read right after it
    is issued): every wait succeeds, the step's results are unchanged."""
    from autopp.runtime import _timeline

    *_, exe, flat, expected = _built(2, "1f1b")
    failed, real = [], jax.block_until_ready

    def recording(x):
        try:
            return real(x)
        except RuntimeError as err:  # waiting on a donated array
            failed.append(str(err))
            raise

    monkeypatch.setattr(_timeline.jax, "block_until_ready", recording)
    outputs, timeline = run_with_timeline(exe, flat)
    assert failed == []
    jax.tree.map(np.testing.assert_array_equal, outputs, expected)
    watched = dict(zip([t.label for t in exe.tasks], _timeline._watch_plan(exe)))
    probed = [label for label in watched if re.fullmatch(r"0B\d", label) and watched[label][1] is not None]
    assert probed == ["0B0", "0B1", "0B2"], watched  # the last one's buffers go to the update, not donated


def test_a_timeline_of_no_measurable_span_still_reports():
    """Every action stamped at one moment (a step so short that all of it had finished when the watchers looked, a
    user trial: 1 in 300 traces) used to divide by zero in ``bubble_fraction`` and so in ``repr``."""
    from autopp.runtime._timeline import TaskEvent, Timeline

    flat = Timeline(events=tuple(TaskEvent(label=f"{s}F0", lane=f"devices {s}", start_s=0.006, end_s=0.006,
                                           issued_s=0.001) for s in range(2)), wall_s=0.006, issue_s=0.002,
                    critical_path_s=0.0)
    assert flat.bubble_fraction() == 0.0
    assert "bubble fraction 0.000" in repr(flat)


def test_the_predicted_panel_shares_the_measured_time_axis(tmp_path, monkeypatch):
    """A step measured at 200 ms and predicted at 20 ms: both panels on one time axis (they were drawn the same width
    each, so a 9x miss did not show)."""
    import matplotlib.pyplot as plt

    from autopp.runtime import _timeline
    from autopp.runtime._timeline import TaskEvent, Timeline

    measured = Timeline(events=(TaskEvent(label="0F0", lane="devices 0", start_s=0.0, end_s=0.2, issued_s=0.0),),
                        wall_s=0.2, issue_s=0.0, critical_path_s=0.2)
    monkeypatch.setattr(_timeline, "_predicted_events", lambda plan: [
        TaskEvent(label="0F0", lane="devices 0", start_s=0.0, end_s=0.02, issued_s=0.0)])
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    measured.plot(tmp_path / "g.png", plan=object())
    (fig,) = figures
    top, bottom = fig.axes[:2]
    assert top.get_xlim() == bottom.get_xlim() and top.get_xlim()[1] >= 200


def test_a_folder_given_as_an_output_file_is_refused(tmp_path):
    train_step, state, batch = gpt_case()
    step = autopp.parallelize(train_step, num_stages=2, num_microbatches=2, devices=jax.devices()[:2])
    with pytest.raises(ValueError, match=r"gantt_png=.* is a folder; give the file to write.*Nothing was run"):
        step.trace(*state, batch, gantt_png=tmp_path)


def test_sends_run_on_the_link_into_their_group(traced_step):
    """A send between stages moves data while its group computes: on the link's lane, it is timed from its producer
    to its arrival; on the group's own lane it waited for the group's earlier tasks (a user trial: a 16 KiB send shown
    as 73.8 ms). The group's lane keeps its actions only."""
    *_, timeline = traced_step
    sends = [e for e in timeline.events if e.label.startswith("send ")]
    assert sends and all(e.lane.startswith("link to devices ") for e in sends)
    assert all(not e.label.startswith("send ") for e in timeline.events if e.lane.startswith("devices "))
