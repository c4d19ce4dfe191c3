"""Checkpoints of a training state, on orbax-checkpoint, in a layout-independent form.

A checkpoint directory holds one sub-directory per step (orbax's ``CheckpointManager``: each step is written
to a temporary directory and renamed when complete, so a failed or interrupted save never touches the
checkpoints already there). A step holds two items:

- ``state``: the state's leaves as one flat dict of global arrays (orbax/tensorstore writes each array's
  shards from wherever they live; what is stored does not depend on the devices or shardings);
- ``autopp``: JSON metadata: the step number, each leaf's pytree path, shape, dtype and the SHA-256 of its
  bytes. Restoring checks the requested structure against it (a wrong tree or shape is refused naming the
  leaf) and checks every restored leaf's checksum, so damaged files are reported instead of restored.
"""

from __future__ import annotations

import datetime
import hashlib
import itertools
import math
import os
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

FORMAT = "autopp-checkpoint"
VERSION = 1
_STATE, _META = "state", "autopp"
_SAVES = itertools.count()  # calls of save in this process: every process makes the same calls, in the same order


class CheckpointCorruptedError(ValueError):
    """A checkpoint's files are damaged or incomplete: its arrays or metadata cannot be read, or an array's
    bytes differ from the checksum recorded when it was saved."""


def _leaf_key(i: int) -> str:
    return f"leaf_{i:05d}"


def _digest(value: np.ndarray) -> str:
    flat = np.ascontiguousarray(value).reshape(-1).view(np.uint8)
    return hashlib.sha256(memoryview(flat)).hexdigest()


def _is_key(x) -> bool:
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _describe_leaf(path, x) -> tuple[dict, Any]:
    """(metadata entry, value to store) for one leaf of the state."""
    where = jax.tree_util.keystr(path)
    entry: dict[str, Any] = {"path": where}
    if _is_key(x):  # typed PRNG keys are stored as their raw data and wrapped again on restore
        entry["key_impl"] = str(jax.random.key_impl(x))
        x = jax.random.key_data(x)
    elif isinstance(x, (bool, int, float, complex)) and not isinstance(x, np.generic):
        entry["python_type"] = type(x).__name__
        x = np.asarray(x)
    elif not isinstance(x, (jax.Array, np.ndarray, np.generic)):
        raise TypeError(
            f"autopp.checkpoint.save: the state's leaf {where} is a {type(x).__name__}, not an array or a Python "
            "number; checkpoints hold arrays. Keep such values outside the saved state (or as arrays).")
    elif isinstance(x, np.generic):
        x = np.asarray(x)
    host = np.asarray(x)
    entry.update(shape=list(host.shape), dtype=str(host.dtype), sha256=_digest(host))
    return entry, x


def _like_entry(path, x) -> dict:
    """What a leaf of ``like`` (array, ShapeDtypeStruct or Python number) asks for: path, shape, dtype."""
    where = jax.tree_util.keystr(path)
    if isinstance(x, (bool, int, float, complex)) and not isinstance(x, np.generic):
        return {"path": where, "shape": [], "dtype": str(np.asarray(x).dtype), "python_type": type(x).__name__}
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"autopp.checkpoint.restore: like's leaf {where} is a {type(x).__name__}; give arrays or "
                        "jax.ShapeDtypeStruct leaves (e.g. like=jax.eval_shape(init_fn, ...)), or the state itself.")
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return {"path": where, "key": True, "shape": list(x.shape)}
    return {"path": where, "shape": list(x.shape), "dtype": str(np.dtype(x.dtype))}


class Checkpointer:
    """Saves and restores training states under ``directory``, one sub-directory per step number.

    ``max_to_keep`` (default: keep all) deletes the oldest steps once a newer step is completely written.
    Use as a context manager, or call :meth:`close`. The module-level :func:`save`, :func:`restore`,
    :func:`latest_step` and :func:`all_steps` open one for a single call.
    """

    def __init__(self, directory: str | os.PathLike, *, max_to_keep: int | None = None):
        import orbax.checkpoint as ocp

        if max_to_keep is not None and (isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int)
                                        or max_to_keep < 1):
            raise ValueError(f"autopp.checkpoint: max_to_keep must be a positive int or None, got {max_to_keep!r}.")
        if not isinstance(directory, (str, os.PathLike)) or not os.fspath(directory):
            raise ValueError(f"autopp.checkpoint: directory={directory!r} names no directory; give the path of the "
                             "directory that holds (or will hold) the checkpoints, e.g. 'checkpoints'.")
        self.directory = os.path.abspath(os.fspath(directory))
        parent = self.directory
        while not os.path.exists(parent):
            parent = os.path.dirname(parent)
        if not os.path.isdir(parent):
            raise ValueError(f"autopp.checkpoint: {parent} is a file, not a directory, so {self.directory} cannot be "
                             "a checkpoint directory; give a directory path.")
        self._ocp = ocp
        # Several processes: each works alone on the shared directory (process 0 writes, every process reads), so
        # orbax waits for no other process (their pipeline stages' arrays are gathered to every process first).
        me = jax.process_index()
        alone = {}
        if jax.process_count() > 1:
            alone = dict(create=False, multiprocessing_options=ocp.options.MultiprocessingOptions(
                primary_host=me, active_processes={me}))
            os.makedirs(self.directory, exist_ok=True)  # (orbax creates it only without active_processes)
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(**{"max_to_keep": max_to_keep, "enable_async_checkpointing": False,
                                                    "create": True, **alone}))

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._manager.close()

    def all_steps(self) -> list[int]:
        """The steps with a complete checkpoint, ascending."""
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest complete step, or None when there is none."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def _step_dir(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    # -- save ------------------------------------------------------------------------------------
    def save(self, step: int, state: Any) -> str:
        """Write ``state`` (any pytree of arrays: jax Arrays on any devices and shardings, numpy arrays, Python
        numbers) as checkpoint ``step``; returns the step's directory. The step number must exceed every
        step already in the directory. Returns once the checkpoint is completely written.

        In a run of several processes every process calls it with the whole state gathered
        (``autopp.distributed.gather(state)``: NumPy arrays on every process); process 0 writes it, and each
        returns once it is written. Every process can then :meth:`restore` it."""
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
            raise TypeError(f"autopp.checkpoint.save: step must be an int (the training step number), got "
                            f"{step!r} ({type(step).__name__}).")
        if step < 0:
            raise ValueError(f"autopp.checkpoint.save: step must be >= 0 (the training step number), got {step}.")
        step = int(step)
        latest = self.latest_step()
        if jax.process_count() > 1:  # every process reads the directory before process 0 writes this step into it
            from autopp._distributed import barrier

            barrier(f"autopp-checkpoint-read-{self.directory}-{step}-{next(_SAVES)}")
        if latest is not None and step <= latest:
            raise ValueError(
                f"autopp.checkpoint.save: {self.directory} already holds step {latest}, and step numbers must "
                f"increase (got {step}); save under a step > {latest}, or into another directory.")
        leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
        if not leaves:
            raise ValueError("autopp.checkpoint.save: the state has no leaves (arrays); pass the training state, "
                             "e.g. (params, opt_state).")
        deleted = [jax.tree_util.keystr(path) for path, x in leaves if isinstance(x, jax.Array) and x.is_deleted()]
        if deleted:
            raise ValueError(
                f"autopp.checkpoint.save: {len(deleted)} leaf/leaves of the state were deleted, e.g. "
                f"{', '.join(deleted[:3])}: they were donated to a step (donate_argnums), which reused their buffers. "
                "Save the state the step returned, not the one passed to it.")
        split = [jax.tree_util.keystr(path) for path, x in leaves
                 if isinstance(x, jax.Array) and not x.is_fully_addressable]
        if split:
            raise ValueError(
                f"autopp.checkpoint.save: {len(split)} leaf/leaves of the state are held partly by other processes, "
                f"e.g. {', '.join(split[:3])}. Gather the state first, on every process: "
                "autopp.checkpoint.save(directory, step, autopp.distributed.gather(state)).")
        entries, items = [], {}
        for i, (path, x) in enumerate(leaves):
            entry, value = _describe_leaf(path, x)
            entries.append(entry)
            if math.prod(entry["shape"]):
                items[_leaf_key(i)] = value
            else:  # orbax stores no zero-size array: the metadata's shape and dtype make it again
                entry["empty"] = True
        meta = {"format": FORMAT, "version": VERSION, "step": step, "treedef": str(treedef), "leaves": entries,
                "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        args = self._ocp.args
        if jax.process_index() == 0:
            self._manager.save(step, args=args.Composite(**{_STATE: args.StandardSave(items),
                                                           _META: args.JsonSave(meta)}), force=True)
            self._manager.wait_until_finished()
        if jax.process_count() > 1:
            from autopp._distributed import barrier

            barrier(f"autopp-checkpoint-{self.directory}-{step}")
        return self._step_dir(step)

    # -- restore ---------------------------------------------------------------------------------
    def metadata(self, step: int | None = None) -> dict:
        """The metadata recorded with checkpoint ``step`` (default the latest): step, leaf paths, shapes, dtypes,
        checksums."""
        return self._read_meta(self._resolve_step(step, "metadata"))

    def _resolve_step(self, step, what: str) -> int:
        steps = self.all_steps()
        if not steps:
            raise ValueError(f"autopp.checkpoint.{what}: {self.directory} holds no complete checkpoint; save one "
                             "with autopp.checkpoint.save(directory, step, state), or check the path.")
        if step is None:
            return steps[-1]
        if step not in steps:
            raise ValueError(f"autopp.checkpoint.{what}: {self.directory} has no checkpoint for step {step}; it has "
                             f"steps {steps}.")
        return int(step)

    def _corrupted(self, step: int, what: str) -> CheckpointCorruptedError:
        earlier = [s for s in self.all_steps() if s < step]
        fix = (f"restore an earlier step instead: restore(..., step={earlier[-1]}) (earlier steps here: "
               f"{earlier})" if earlier else "no earlier step is in this directory to fall back to")
        return CheckpointCorruptedError(
            f"autopp.checkpoint: the checkpoint of step {step} in {self._step_dir(step)} is damaged: {what}. "
            f"{fix[0].upper()}{fix[1:]}; to save step {step} or later steps here again, delete or move the damaged "
            "directory first.")

    def _read_meta(self, step: int) -> dict:
        args = self._ocp.args
        try:
            meta = self._manager.restore(step, args=args.Composite(**{_META: args.JsonRestore()}))[_META]
        except Exception as e:  # orbax / json raise many kinds for unreadable files
            raise self._corrupted(step, f"its metadata cannot be read ({_brief(e)})") from e
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise self._corrupted(step, "its metadata is not an autopp checkpoint's (was it written by "
                                        "autopp.checkpoint.save?)")
        if meta.get("version") != VERSION:
            raise ValueError(f"autopp.checkpoint: step {step} in {self.directory} has format version "
                             f"{meta.get('version')}, this autopp reads version {VERSION}; use the autopp that "
                             "wrote it.")
        return meta

    def restore(self, step: int | None = None, *, like: Any = None, shardings: Any = None,
                verify: bool = True) -> Any:
        """Read checkpoint ``step`` (default the latest).

        ``like`` is a pytree with the state's structure (the state itself, or ``jax.ShapeDtypeStruct`` leaves,
        e.g. from ``jax.eval_shape``); the result has its structure, and a leaf whose path, shape or dtype
        differs from the checkpoint's is refused with a ValueError naming it. Without ``like`` the result is a
        dict from leaf path (``jax.tree_util.keystr``) to array.

        Where the arrays go does not depend on where they were saved from: by default they are numpy arrays in
        host memory (a pipelined step places its inputs on its own stages, whatever plan it runs); with
        ``shardings`` (one ``jax.sharding.Sharding`` for every leaf, or a pytree of them with ``like``'s
        structure, ``None`` for host) they are read straight into those shardings. ``verify`` checks every
        leaf's bytes against the checksum recorded at save time (a :class:`CheckpointCorruptedError` says which
        leaf differs).
        """
        step = self._resolve_step(step, "restore")
        meta = self._read_meta(step)
        saved = meta["leaves"]
        treedef = None
        if like is not None:
            like_leaves, treedef = jax.tree_util.tree_flatten_with_path(like)
            _check_like(saved, [_like_entry(p, x) for p, x in like_leaves], step, self._step_dir(step))
        targets, per = _targets(saved, shardings, treedef)
        args = self._ocp.args
        try:
            items = self._manager.restore(step, args=args.Composite(**{_STATE: args.StandardRestore(
                {_leaf_key(i): t for i, t in enumerate(targets) if not saved[i].get("empty")})}))[_STATE]
        except Exception as e:
            raise self._corrupted(step, f"its arrays cannot be read ({_brief(e)})") from e
        values = []
        for i, entry in enumerate(saved):
            if entry.get("empty"):
                x = np.zeros(entry["shape"], _np_dtype(entry["dtype"]))
                x = x if per[i] is None or "key_impl" in entry else jax.device_put(x, per[i])
            else:
                x = items[_leaf_key(i)]
            if verify and _digest(np.asarray(x)) != entry["sha256"]:
                raise self._corrupted(step, f"leaf {entry['path']} does not match the checksum recorded when it "
                                            "was saved")
            if "key_impl" in entry:
                x = jax.random.wrap_key_data(x, impl=entry["key_impl"])
                if per[i] is not None:
                    x = jax.device_put(x, per[i])
            elif "python_type" in entry:
                x = {"bool": bool, "int": int, "float": float, "complex": complex}[entry["python_type"]](x[()])
            values.append(x)
        if treedef is None:
            return {entry["path"]: x for entry, x in zip(saved, values)}
        return jax.tree_util.tree_unflatten(treedef, values)


def _brief(e: BaseException) -> str:
    """An exception from orbax/tensorstore in one line, without the storage spec tensorstore appends."""
    text = str(e).split(" [tensorstore_spec", 1)[0].strip()
    return f"{type(e).__name__}: {text[:400]}" + ("..." if len(text) > 400 else "")


def _check_like(saved: Sequence[dict], wanted: Sequence[dict], step: int, where: str) -> None:
    fix = ("Pass like= with the structure of the saved state (e.g. the freshly initialized state of the same model "
           "and optimizer)")
    saved_paths, wanted_paths = [e["path"] for e in saved], [e["path"] for e in wanted]
    if saved_paths != wanted_paths:
        missing = [p for p in saved_paths if p not in set(wanted_paths)]
        extra = [p for p in wanted_paths if p not in set(saved_paths)]
        detail = []
        if missing:
            detail.append(f"saved but not in like: {', '.join(missing[:5])}" + (" ..." if len(missing) > 5 else ""))
        if extra:
            detail.append(f"in like but not saved: {', '.join(extra[:5])}" + (" ..." if len(extra) > 5 else ""))
        if not detail:
            detail.append("the same leaves in another order")
        raise ValueError(f"autopp.checkpoint.restore: like's tree differs from the state saved as step {step} in "
                         f"{where} ({len(wanted_paths)} leaves vs {len(saved_paths)}): {'; '.join(detail)}. {fix}.")
    for s, w in zip(saved, wanted):
        if w.get("key"):
            if "key_impl" not in s or s["shape"][:len(w["shape"])] != w["shape"]:
                raise ValueError(f"autopp.checkpoint.restore: leaf {s['path']}: like has a PRNG key array of shape "
                                 f"{tuple(w['shape'])}, the checkpoint a {s['dtype']} array of shape "
                                 f"{tuple(s['shape'])}. {fix}.")
            continue
        if "key_impl" in s:
            raise ValueError(f"autopp.checkpoint.restore: leaf {s['path']} was saved as a PRNG key array but like "
                             f"has a {w['dtype']} array there. {fix}.")
        dtypes = (s["dtype"], w["dtype"])
        if "python_type" in s or "python_type" in w:  # a Python number's dtype is numpy's; JAX's may be narrower
            dtypes = tuple(str(jax.dtypes.canonicalize_dtype(np.dtype(d))) for d in dtypes)
        if s["shape"] != w["shape"] or dtypes[0] != dtypes[1]:
            raise ValueError(
                f"autopp.checkpoint.restore: leaf {s['path']} was saved as {s['dtype']}{s['shape']} but like asks for "
                f"{w['dtype']}{w['shape']}. {fix}: a model of the same sizes and dtypes.")


def _targets(saved: Sequence[dict], shardings: Any, treedef) -> tuple[list, list]:
    """What orbax restores each stored leaf as (a numpy array for host, or a ShapeDtypeStruct with a sharding),
    and each leaf's sharding (None: host)."""
    n = len(saved)
    if shardings is None:
        per = [None] * n
    elif isinstance(shardings, jax.sharding.Sharding):
        per = [shardings] * n
    else:
        if treedef is None:
            raise ValueError("autopp.checkpoint.restore: shardings given as a pytree needs like= with the same "
                             "structure; or pass one jax.sharding.Sharding for every leaf.")
        try:
            per = treedef.flatten_up_to(shardings)
        except (ValueError, TypeError) as e:
            raise ValueError(f"autopp.checkpoint.restore: shardings must be one jax.sharding.Sharding or a pytree "
                             f"of them (None for host) with like's structure: {e}") from None
        bad = [(saved[i]["path"], s) for i, s in enumerate(per)
               if s is not None and not isinstance(s, jax.sharding.Sharding)]
        if bad:
            raise TypeError(f"autopp.checkpoint.restore: shardings has {bad[0][1]!r} at {bad[0][0]}; give a "
                            "jax.sharding.Sharding (or None for a host numpy array) per leaf.")
    targets = []
    for entry, sh in zip(saved, per):
        if sh is None or "key_impl" in entry or "python_type" in entry:  # keys are placed after wrapping
            targets.append(np.zeros(entry["shape"], _np_dtype(entry["dtype"])))
        else:
            targets.append(jax.ShapeDtypeStruct(tuple(entry["shape"]), _np_dtype(entry["dtype"]), sharding=sh))
    return targets, per


def _np_dtype(name: str) -> np.dtype:
    try:
        return np.dtype(name)
    except TypeError:
        return np.dtype(getattr(jax.numpy, name))  # bfloat16, float8_*: ml_dtypes types


def save(directory: str | os.PathLike, step: int, state: Any, *, max_to_keep: int | None = None) -> str:
    """Save ``state`` as checkpoint ``step`` under ``directory`` (see :meth:`Checkpointer.save`)."""
    with Checkpointer(directory, max_to_keep=max_to_keep) as ckpt:
        return ckpt.save(step, state)


def _existing(directory, what: str) -> None:
    if os.path.isfile(directory):
        raise ValueError(f"autopp.checkpoint.{what}: {os.path.abspath(directory)} is a file; give the directory "
                         "checkpoints were saved in (the one passed to save).")
    if not os.path.isdir(directory):
        raise ValueError(f"autopp.checkpoint.{what}: there is no directory {os.path.abspath(directory)}; give the "
                         "directory checkpoints were saved in.")


def restore(directory: str | os.PathLike, step: int | None = None, *, like: Any = None, shardings: Any = None,
            verify: bool = True) -> Any:
    """Restore checkpoint ``step`` (default the latest) from ``directory`` (see :meth:`Checkpointer.restore`)."""
    _existing(directory, "restore")
    with Checkpointer(directory) as ckpt:
        return ckpt.restore(step, like=like, shardings=shardings, verify=verify)


def latest_step(directory: str | os.PathLike) -> int | None:
    """The newest complete checkpoint's step under ``directory``, or None (also when it does not exist)."""
    if not os.path.isdir(directory):
        return None
    with Checkpointer(directory) as ckpt:
        return ckpt.latest_step()


def all_steps(directory: str | os.PathLike) -> list[int]:
    """The complete checkpoints' steps under ``directory``, ascending."""
    if not os.path.isdir(directory):
        return []
    with Checkpointer(directory) as ckpt:
        return ckpt.all_steps()


def metadata(directory: str | os.PathLike, step: int | None = None) -> dict:
    """The metadata of checkpoint ``step`` (default the latest): step, leaf paths, shapes, dtypes, checksums."""
    _existing(directory, "metadata")
    with Checkpointer(directory) as ckpt:
        return ckpt.metadata(step)

