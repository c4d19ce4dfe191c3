"""``autopp show``: a saved plan's stage table, predicted timeline, schedule grid, per-layer shardings and planner
statistics."""

from __future__ import annotations

import re


_PATH_TOKEN = re.compile(r"\[[^\]]*\]|\.[A-Za-z_]\w*|[A-Za-z_]\w*")


def _path_tokens(path: str) -> list[str]:
    """``args[0]['blocks'][3]['attn']['wq']`` -> ``['args', '[0]', "['blocks']", '[3]', ...]`` (a name that is not
    a pytree path: itself)."""
    tokens = _PATH_TOKEN.findall(path)
    return tokens if "".join(tokens) == path else [path]


def _render_path(tokens) -> str:
    """Tokens as a dotted path: ``['blocks'][*]['wq']`` -> ``blocks[*].wq``."""
    out = ""
    for tok in tokens:
        if tok.startswith("['") or tok.startswith('["'):
            out += ("." if out else "") + tok[2:-2]
        elif tok.startswith("."):
            out += tok if out else tok[1:]
        elif tok.startswith("["):
            out += tok
        else:
            out += ("." if out else "") + tok
    return out


def _range_names(names: list[str]) -> str:
    """``block 0, block 1, ..., block 95, head`` -> ``block 0-95, head``."""
    runs: list[list] = []  # [prefix, first, last] or [name]
    for n in names:
        prefix, _, num = n.rpartition(" ")
        if prefix and num.isdigit():
            k = int(num)
            if runs and len(runs[-1]) == 3 and runs[-1][0] == prefix and runs[-1][2] == k - 1:
                runs[-1][2] = k
                continue
            runs.append([prefix, k, k])
        else:
            runs.append([n])
    return ", ".join(r[0] if len(r) == 1 else f"{r[0]} {r[1]}" + (f"-{r[2]}" if r[2] != r[1] else "") for r in runs)


def _seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} us"


def _collective_summary(items) -> str:
    """``2 all-reduce + 1 all-gather, 96.0 MiB, 1.2 ms`` (or ``none``)."""
    from autopp._metrics import format_bytes

    if not items:
        return "none"
    counts: dict[str, int] = {}
    for kind, _, _ in items:
        counts[kind] = counts.get(kind, 0) + 1
    total_bytes = sum(b for _, b, _ in items)
    total_s = sum(sec for _, _, sec in items)
    return f"{' + '.join(f'{n} {k}' for k, n in counts.items())}, {format_bytes(int(total_bytes))}, " \
           f"{_seconds(total_s)}"


def sharding_lines(plan) -> list[str]:
    """One line per distinct layer sharding of ``plan``, identical layers grouped (``block 0-95: ...``): the
    parameters by layout (``S(d)`` split along dimension ``d`` over the tensor axis, ``R`` replicated), then the
    tensor-parallel collectives of one microbatch in that layer, forward and backward (count and kind, total bytes
    and seconds)."""
    reports = plan.layer_shardings
    if not reports:
        return []
    heads = {tuple(_path_tokens(p)[:2]) for r in reports for p in r.params}
    strip = 2 if len(heads) == 1 and next(iter(heads))[0] == "args" else 0  # all in one argument: drop its args[i]
    groups: dict[tuple, list] = {}
    for r in reports:
        items = []
        for path, layout in r.params.items():
            toks = _path_tokens(path)[strip:] or _path_tokens(path)
            items.append((tuple("[*]" if t[1:-1].isdigit() else t for t in toks), tuple(toks), layout))
        items.sort()
        comm = tuple((kind, float(f"{float(b):.6g}"), float(f"{float(sec):.6g}"), when)
                     for kind, b, sec, when in r.collectives)
        key = (tuple((norm, layout) for norm, _, layout in items), comm)
        groups.setdefault(key, []).append((r, items))
    tensor = max((st.mesh_shape.get("tensor", 1) for st in plan.stages), default=1)
    lines = [f"layer sharding ({len(reports)} layers, {len(groups)} distinct; tensor axis of {tensor} device"
             f"{'s' if tensor != 1 else ''}: S(d) split along dimension d, R replicated; collectives per layer and "
             "microbatch):"]
    for (_, comm), members in groups.items():
        name = _range_names([r.name for r, _ in members])
        first = members[0][1]
        paths = [[t if all(m[1][i][1][j] == t for m in members) else "[*]" for j, t in enumerate(full)]
                 for i, (_, full, _) in enumerate(first)]
        common = 0
        if len(paths) > 1:
            while all(len(p) > common + 1 and p[common] == paths[0][common] for p in paths):
                common += 1
        by_layout: dict[str, list[str]] = {}
        for toks, (_, _, layout) in zip(paths, first):
            by_layout.setdefault(layout, []).append(_render_path(toks[common:]))
        order = sorted(by_layout, key=lambda lay: (lay == "R", lay))
        params = ", ".join(f"{lay} {' '.join(by_layout[lay])}" for lay in order) or "no parameters"
        if common:
            params = f"{_render_path(paths[0][:common])}: {params}"
        passes = []
        for when in ("forward", "backward"):
            passes.append(f"{when}: {_collective_summary([(k, b, sec) for k, b, sec, w in comm if w == when])}")
        lines.append(f"  {name}: {params} | {' | '.join(passes)}")
    return lines


def cmd_show(args) -> int:
    from autopp.core import split_summary
    from autopp.planner import Plan
    from autopp.runtime import Schedule

    plan = Plan.from_json(args.plan)
    print(f"plan {args.plan} (schema {plan.schema_version}, model fingerprint {plan.model_fingerprint})")
    print(plan)
    timeline = plan.timeline()
    if timeline:
        print(timeline)
    sched = Schedule.from_text(plan.schedule_text, num_stages=plan.num_stages, num_microbatches=plan.num_microbatches)
    if args.grid or not timeline:
        print("schedule:")
        print(sched)
    for line in sharding_lines(plan):
        print(line)
    if plan.planner is not None:
        st = plan.planner
        print("planner statistics:")
        print(f"  wall time            {st.wall_time_s:.2f} s")
        print(f"  layouts evaluated    {st.candidates}")
        print(f"  layouts bounded out  {st.bounded} (their compute alone could not beat the layouts kept)")
        print(f"  stage split          {split_summary(plan)}")
        print(f"  best equal split     {st.best_uniform_step_time_s:.4g} s per step")
        print(f"  sharding ILPs        {st.sharding_solves} solve{'s' if st.sharding_solves != 1 else ''} in "
              f"{st.sharding_solve_s:.2f} s, largest gap {100 * st.sharding_max_gap:.2g}%")
    return 0
