"""dispatch.nn modules keep their last decision (dispatch.memo.Memo) and decide again whenever what it was made
from changes: the input's shape, dtype or grad, the mode, use_backend, or the caches being emptied."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from dispatch import select, use_backend
from dispatch.nn import FusedMLP, FusedRMSNorm


class Counted:
    """Counts the module's plain-PyTorch runs (its module_forward) and passes them through."""

    def __init__(self, module: FusedMLP) -> None:
        self.runs, self.inner = 0, module.module_forward
        module.module_forward = self

    def __call__(self, x):
        self.runs += 1
        return self.inner(x)


def mlp() -> FusedMLP:
    return FusedMLP(8, 16, activation="swiglu")


def test_a_use_backend_block_is_seen_by_a_module_that_decided_before_it():
    m, x = mlp(), torch.randn(3, 8)
    counted = Counted(m)
    with use_backend("pytorch"):
        m(x)
    with use_backend("eager"):
        y = m(x)
    assert counted.runs == 1
    with use_backend("pytorch"):
        assert torch.equal(m(x), y)
    assert counted.runs == 2


def test_emptied_caches_and_a_new_environment_are_seen(monkeypatch):
    m, x = mlp(), torch.randn(3, 8)
    counted = Counted(m)
    monkeypatch.setenv("DISPATCH_BACKEND", "eager")
    select.clear_cache()
    try:
        m(x)
        assert counted.runs == 0
        monkeypatch.setenv("DISPATCH_BACKEND", "pytorch")
        select.clear_cache()
        m(x)
        assert counted.runs == 1
    finally:
        monkeypatch.delenv("DISPATCH_BACKEND")
        select.clear_cache()


@pytest.mark.parametrize("change", ["shape", "dtype", "grad", "mode", "dropout"])
@use_backend("pytorch")  # with no table on this CPU a module skips the memo (tests/test_plain_path.py)
def test_the_call_key_is_made_again_when_the_input_or_mode_changes(change, monkeypatch):
    m, x = mlp(), torch.randn(3, 8)
    made = []
    real = m._call
    monkeypatch.setattr(m, "_call", lambda *a: made.append(1) or real(*a))
    m(x)
    m(x)
    assert len(made) == 1  # the same probe: the memo answers
    if change == "shape":
        m(torch.randn(5, 8))
    elif change == "dtype":
        m.double()(x.double())
    elif change == "grad":
        with torch.no_grad():
            m(x)
    elif change == "mode":
        m.eval()(x)
    else:
        m.p = 0.1
        m(x)
    assert len(made) == 2


def test_copies_and_pickles_start_empty_and_still_decide():
    m, x = mlp(), torch.randn(3, 8)
    norm = FusedRMSNorm(8)
    m(x), norm(x)
    assert m._memo.found is not None and norm._memo.found is not None
    for twin in (copy.deepcopy(m), pickle.loads(pickle.dumps(m))):
        assert twin._memo.found is None
        assert torch.equal(twin(x), m(x))
    twin_norm = copy.deepcopy(norm)
    assert twin_norm._memo.found is None and torch.equal(twin_norm(x), norm(x))


@use_backend("pytorch")
def test_the_probe_and_its_decision_are_kept_as_one_pair():
    m = mlp()
    for rows in (3, 5):
        m(torch.randn(rows, 8))
        ((shape, _, _), _, _, _), found = m._memo.entry
        assert shape == (rows, 8) and found.call.shape[0] == rows


def test_device_type_and_key_without_a_device_object_agree_with_it():
    from dispatch.nn.layers import _device_type, device_key

    for t in (torch.empty(2), torch.empty(2, device="meta")):
        assert _device_type(t) == t.device.type
    assert device_key(torch.empty(2)) == -1
    meta = torch.empty(2, device="meta")
    assert device_key(meta) == meta.device and device_key(meta) != device_key(torch.empty(2))
    if torch.cuda.is_available():
        cuda = torch.empty(2, device="cuda")
        assert _device_type(cuda) == "cuda" and device_key(cuda) == cuda.device.index
