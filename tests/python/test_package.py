"""The package as users meet it: import cost, the elastrun_control alias, help(), the data sampler."""

import os
import subprocess

import pytest

import elastrun
import elastrun.data as ed

PYTHON = "/usr/bin/python3"


def test_import_elastrun_is_cheap_and_lazy():
    code = "import sys, elastrun; assert 'torch' not in sys.modules and 'elastrun._core' not in sys.modules; " \
           "import elastrun.control; assert 'torch' not in sys.modules; print(elastrun.__version__)"
    out = subprocess.run([PYTHON, "-c", code], check=True, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == elastrun.__version__


def test_elastrun_control_is_an_alias_of_elastrun_control():
    here = os.path.dirname(os.path.abspath(__file__))
    launcher_python = os.path.join(here, "..", "..", "launcher", "python")
    code = "import elastrun_control, elastrun.control; assert elastrun_control is elastrun.control; " \
           "print(elastrun_control.CHECKPOINTED_EXIT_CODE)"
    env = dict(os.environ, PYTHONPATH=f"{launcher_python}:{os.environ.get('PYTHONPATH', '')}")
    out = subprocess.run([PYTHON, "-c", code], check=True, capture_output=True, text=True, timeout=60, env=env)
    assert out.stdout.strip() == "85"
    # the source tree alone (no build on the path) still finds it
    env = dict(os.environ, PYTHONPATH=launcher_python)
    subprocess.run([PYTHON, "-c", code], check=True, capture_output=True, text=True, timeout=60, env=env)


def test_help_documents_the_api():
    import elastrun.checkpoint as ec

    for obj in (ec, ec.save, ec.load, ec.AsyncSaver, ec.AsyncSaver.save, ec.Shard, ed.ElasticSampler,
                elastrun.control.poll_all):
        assert obj.__doc__ and len(obj.__doc__) > 40, obj
    assert ec.save.__annotations__ and ec.load.__annotations__


def consumed(world, steps, **kw):
    """Dataset indices of `steps` steps over all ranks, in global order."""
    out = []
    for step in range(steps):
        for rank in range(world):
            out += ed.ElasticSampler(50, 12, rank=rank, world_size=world, seed=3, **kw).batch_at(step)
    return out


def test_sampler_order_does_not_depend_on_the_world_size():
    reference = consumed(1, 10)
    assert consumed(2, 10) == reference and consumed(5, 10) == reference and consumed(7, 10) == reference
    # every sample once per epoch (50 samples, 120 positions: epochs 0, 1 whole)
    assert sorted(reference[:50]) == list(range(50)) and sorted(reference[50:100]) == list(range(50))
    assert reference[:50] != reference[50:100]  # reshuffled per epoch


def test_sampler_resumes_where_a_failure_left_it():
    reference = consumed(3, 10)
    first = consumed(3, 4)
    position = ed.ElasticSampler(50, 12, rank=0, world_size=3).position_after(4)
    # resume at another world size from the stored position
    resumed = consumed(2, 6, start_index=position)
    assert first + resumed == reference


def test_sampler_works_as_a_dataloader_batch_sampler():
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    data = TensorDataset(torch.arange(20))
    sampler = ed.ElasticSampler(20, 8, rank=1, world_size=3, shuffle=False, num_steps=3)
    batches = [b[0].tolist() for b in DataLoader(data, batch_sampler=sampler)]
    assert batches == [[3, 4, 5], [11, 12, 13], [19, 0, 1]]


def test_sampler_rejects_bad_arguments():
    with pytest.raises(ValueError, match="smaller than the world size"):
        ed.ElasticSampler(10, 2, rank=0, world_size=3)
    with pytest.raises(ValueError, match="not a valid rank"):
        ed.ElasticSampler(10, 6, rank=3, world_size=3)


def test_a_checkpoint_without_key_types_fills_int_keyed_entries():
    # C++ writes no structure: every key is a str; the caller's int keys (optimizer state) still
    # receive their tensors instead of new "0" entries beside them.
    import torch
    from elastrun import _tree

    spec = _tree.spec_from_names(["optim/state/0/exp_avg", "model/w"])
    callers = torch.zeros(1)
    mine = {"optim": {"state": {0: {"exp_avg": callers}}}, "model": {}}
    seen = {}

    def make_tensor(leaf, existing):
        seen[leaf["name"]] = existing
        return existing if existing is not None else "created"

    built = _tree.build(spec, mine, make_tensor)
    assert list(built["optim"]["state"]) == [0] and seen["optim/state/0/exp_avg"] is callers
    assert built["model"]["w"] == "created"


def test_flatten_names_are_unique_and_valid():
    from elastrun import _tree
    import torch

    tree = {"a/b": torch.ones(1), "a": {"b": torch.ones(1)}, "": torch.ones(1), ".": torch.ones(1),
            "_elastrun": torch.ones(1), 3: [torch.ones(1), {"x": torch.ones(1)}]}
    names = [leaf.name for leaf in _tree.flatten(tree).tensors]
    assert names == ["a%2Fb", "a/b", "%", "%2E", "%5Felastrun", "3/0", "3/1/x"]
    with pytest.raises(_tree.TreeError, match="same dataset name"):
        _tree.flatten({0: torch.ones(1), "0": torch.ones(1)})
