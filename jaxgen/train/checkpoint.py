"""Orbax checkpoints of a training state (params, optimizer state, step): save every N steps,
resume from the newest.

Example:
    >>> import tempfile, jax.numpy as jnp
    >>> folder = tempfile.mkdtemp()
    >>> manager = checkpoint_manager(folder)
    >>> save_state(manager, 3, {"w": jnp.arange(3.0), "step": jnp.int32(3)})
    >>> step, state = restore_latest(manager, {"w": jnp.zeros(3), "step": jnp.int32(0)})
    >>> step, state["w"].tolist()
    (3, [0.0, 1.0, 2.0])
    >>> manager.close()
"""
from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp


def checkpoint_manager(folder: str, keep: int = 2) -> ocp.CheckpointManager:
    """A manager over `folder` (created) keeping the newest `keep` checkpoints."""
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
    return ocp.CheckpointManager(os.path.abspath(folder), options=options)


def save_state(manager: ocp.CheckpointManager, step: int, state) -> None:
    """Writes `state` (any PyTree of arrays) as checkpoint `step` and waits for it."""
    manager.save(int(step), args=ocp.args.StandardSave(state), force=True)
    manager.wait_until_finished()


def restore_latest(manager: ocp.CheckpointManager, like):
    """(step, state) of the newest checkpoint, restored into the structure, shapes and dtypes
    of `like` (arrays or jax.ShapeDtypeStruct), or None when the folder has none."""
    step = manager.latest_step()
    if step is None:
        return None
    abstract = jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), like)
    return step, manager.restore(step, args=ocp.args.StandardRestore(abstract))
