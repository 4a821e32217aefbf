"""elastrun: elastic, fault-tolerant PyTorch training on Slurm -- the Python side.

    elastrun.checkpoint   sharded HDF5 checkpoints of state_dicts (atomic commit, resharding
                          restore at any world size, async save, integrity checks)
    elastrun.control      the agent's control channel (checkpoint-and-stop on Slurm's signals)
    elastrun.convert      torch.save files and DCP directories in and out (elastrun-ckpt import/export)
    elastrun.data         ElasticSampler: exactly-once data order whatever the world size
    elastrun.events       event logs, schema v1: the writer, the reader and the job's timeline
    elastrun.memory       the memory checkpoint tier: snapshots kept in the node agent's memory
    elastrun.node         requests to this node's agent (its Unix-socket endpoint)

Submodules load on first use, so ``import elastrun`` stays cheap (no torch, no HDF5).
Guide: docs/python.md. The launcher itself is the ``elastrun`` command.
"""

import importlib
from typing import Any

__version__ = "0.1.0"
__all__ = ["checkpoint", "control", "convert", "data", "events", "memory", "node", "__version__"]


def __getattr__(name: str) -> Any:
    if name in ("checkpoint", "control", "convert", "data", "events", "memory", "node"):
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'elastrun' has no attribute '{name}'")


def __dir__() -> list:
    return sorted(__all__)
