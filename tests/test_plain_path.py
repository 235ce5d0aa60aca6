"""A module whose only pick on its device is plain PyTorch (no table serves the device, or every cell
of the table for its op and activation names pytorch) runs its own forward with no decision per call,
and decides again the moment anything could change that: use_backend(), DISPATCH_BACKEND, spec_masks(),
emptied caches, parameters moved or cast. Where plain PyTorch is its pick over one segment of a table
cell, inputs of any size in that segment run it with no decision either (the memo's span)."""

from __future__ import annotations

import json

import pytest
import torch

from dispatch import heuristics, select, spec_masks, use_backend
from dispatch.nn import FusedMLP, FusedRMSNorm

H, F = 8, 16


class Counted:
    """Counts a module's decision keys made (its ``_call``) and its plain-PyTorch runs."""

    def __init__(self, m: FusedMLP) -> None:
        self.keys = self.plain = 0
        make, run = m._call, m.module_forward

        def made(*args):
            self.keys += 1
            return make(*args)

        def ran(x):
            self.plain += 1
            return run(x)

        m._call, m.module_forward = made, ran


def _segment(backend: str, m_from: int = 1) -> dict:
    return {"m_from": m_from, "backend": backend, "runner_up": "eager", "margin": 0.2, "m": 64,
            "clock": "gpu", "gpu_backend": backend, "gpu_us": {backend: 9.0, "eager": 12.0},
            "host_us": {backend: 4.0, "eager": 5.0}}  # fmt: skip


def _write(user, cells: dict[str, list[dict]], op: str = "fused_mlp") -> None:
    """A CPU table of float32 cells in both modes: fused_mlp's by activation -> its segments, or
    add_norm's by norm -> its segments."""
    info = heuristics.device_info(torch.device("cpu"))
    if op == "fused_mlp":
        traits = [({"activation": act, "dropout": False, "features": [H, F]}, segs)
                  for act, segs in cells.items()]  # fmt: skip
    else:
        traits = [({"norm": norm, "features": [H]}, segs) for norm, segs in cells.items()]
    entries = [{"op": op, "dtype": "float32", "mode": mode, **keys, "segments": segs}
               for keys, segs in traits for mode in ("inference", "training")]  # fmt: skip
    table = {"schema_version": heuristics.SCHEMA_VERSION, "device": info,
             "versions": heuristics.running_versions(), "entries": entries}  # fmt: skip
    (user / f"{info['slug']}.json").write_text(json.dumps(table))
    heuristics.reload()
    select.clear_cache()


def _mlp() -> FusedMLP:
    return FusedMLP(H, F, activation="swiglu")


def test_without_a_table_the_block_decides_once_then_runs_its_own_forward(user_dir):
    m = _mlp()
    counted = Counted(m)
    x = torch.randn(3, H)
    want = m(x)
    assert counted.keys == 1 and m._memo.token is select._plain_token
    for rows in (3, 5, 7):
        m(torch.randn(rows, H))
    m.eval()(x)
    with torch.no_grad():
        assert torch.equal(m(x), want)
    assert counted.keys == 1 and counted.plain == 6


def test_a_table_naming_another_backend_for_the_activation_decides_per_input(user_dir):
    _write(user_dir, {"swiglu": [_segment("pytorch"), _segment("eager", 5)]})
    m = _mlp()
    counted = Counted(m)
    m(torch.randn(3, H))
    assert m._memo.token is None and counted.plain == 1
    m(torch.randn(6, H))  # M = 6: eager's segment
    assert counted.keys == 2 and counted.plain == 1


def test_a_table_whose_cells_for_the_activation_all_name_pytorch_gives_the_token(user_dir):
    _write(user_dir, {"swiglu": [_segment("pytorch")], "geglu": [_segment("eager")]})
    m = _mlp()
    m(torch.randn(3, H))
    assert m._memo.token is select._plain_token
    geglu = FusedMLP(H, F, activation="geglu")
    geglu(torch.randn(3, H))
    assert geglu._memo.token is None


def test_use_backend_the_environment_and_spec_masks_are_seen_by_an_armed_block(user_dir, monkeypatch):
    m = _mlp()
    counted = Counted(m)
    x = torch.randn(3, H)
    m(x)
    with use_backend("eager"):
        m(x)
    assert counted.plain == 1
    monkeypatch.setenv("DISPATCH_BACKEND", "eager")
    select.clear_cache()
    m(x)
    assert counted.plain == 1 and m._memo.token is None
    monkeypatch.delenv("DISPATCH_BACKEND")
    select.clear_cache()
    m(x)
    assert counted.plain == 2 and m._memo.token is select._plain_token
    drop = FusedMLP(H, F, activation="swiglu", p=0.5)
    runs = Counted(drop)
    drop(x)
    assert runs.plain == 1
    with spec_masks():
        drop(x)  # torch's masks may not serve: the spec's backend runs
        assert runs.plain == 1
    drop(x)
    assert runs.plain == 2


def test_moving_or_casting_the_parameters_drops_the_token(user_dir):
    m = _mlp()
    counted = Counted(m)
    m(torch.randn(3, H))
    m.double()
    assert m._memo.token is None
    y = m(torch.randn(3, H, dtype=torch.float64))
    assert y.dtype == torch.float64 and counted.keys == 2 and m._memo.token is select._plain_token


def test_the_norm_module_takes_the_same_path(user_dir):
    norm = FusedRMSNorm(H)
    x = torch.randn(4, H)
    want = norm(x)
    assert norm._memo.token is select._plain_token
    assert torch.equal(norm(x), want)
    with pytest.raises(ValueError, match="hidden_size=8"):
        norm(torch.randn(4, H + 1))
    norm.double()
    assert norm._memo.token is None


def test_a_table_for_every_activation_but_ours_still_gives_the_token():
    """backends_named reads only the entries of the op and traits asked for."""
    info = heuristics.device_info(torch.device("cpu"))
    seg = _segment("eager")
    entries = [{"op": "fused_mlp", "dtype": "float32", "activation": "gelu", "mode": "inference",
                "dropout": dropout, "features": [H, F], "segments": [seg]} for dropout in (False, True)]
    doc = {"schema_version": heuristics.SCHEMA_VERSION, "device": info,
           "versions": heuristics.running_versions(), "entries": entries}
    table = heuristics.Table(doc, "test")
    assert table.backends_named("fused_mlp", {"activation": "gelu"}) == {"eager"}
    assert table.backends_named("fused_mlp", {"activation": "swiglu"}) == set()
    assert table.backends_named("fused_linear", {"activation": "gelu"}) == set()


def _sizes(m: FusedMLP, shapes) -> None:
    """Calls m on inputs of these shapes; each output equals the module's own forward's, bitwise."""
    for shape in shapes:
        x = torch.randn(*shape)
        assert torch.equal(m(x), FusedMLP.module_forward(m, x))


def test_a_plain_decision_holds_over_its_table_segment_and_no_further(user_dir):
    _write(user_dir, {"swiglu": [_segment("pytorch"), _segment("eager", 5)]})
    m = _mlp()
    counted = Counted(m)
    _sizes(m, [(3, H), (4, H), (1, H), (2, 2, H), (1, 4, H)])  # M = 3, 4, 1, 4, 4: one segment
    assert m._memo.token is None and counted.keys == 1 and counted.plain == 5
    _sizes(m, [(5, H)])  # M = 5: eager's segment decides again, and eager runs
    assert counted.keys == 2 and counted.plain == 5 and m._memo.span is None
    _sizes(m, [(2, H), (3, H)])
    assert counted.keys == 3 and counted.plain == 7


def test_the_span_holds_for_its_state_only(user_dir):
    _write(user_dir, {"swiglu": [_segment("pytorch"), _segment("eager", 5)]})
    m = _mlp()
    counted = Counted(m)
    x = torch.randn(3, H)
    m(x)
    with torch.no_grad():  # another mode: decided again, then its own span
        m(x), m(torch.randn(2, H))
    assert counted.keys == 2 and counted.plain == 3
    m.eval()(x)  # module mode: eval is no dropout here either, yet decided again (the state differs)
    assert counted.keys == 3 and counted.plain == 4
    with use_backend("eager"):
        m(x)
    assert counted.plain == 4
    with torch.autocast("cpu", dtype=torch.bfloat16):
        m(x)  # autocast's dtype: a bfloat16 call, no cell, plain PyTorch by default, decided anew
    assert counted.keys == 5 and counted.plain == 5
    m.double()
    assert m._memo.span is None and m._memo.token is None
    assert m(x.double()).dtype == torch.float64 and counted.keys == 6


def test_a_span_dies_with_the_caches_generation(user_dir):
    _write(user_dir, {"swiglu": [_segment("pytorch"), _segment("eager", 5)]})
    m = _mlp()
    counted = Counted(m)
    m(torch.randn(3, H))
    _write(user_dir, {"swiglu": [_segment("eager")]})  # a new table: the caches emptied
    m(torch.randn(3, H))
    assert counted.keys == 2 and counted.plain == 1 and m._memo.span is None


def test_the_norm_module_keeps_a_span_too(user_dir):
    _write(user_dir, {"rms": [_segment("pytorch"), _segment("eager", 5)]}, op="add_norm")
    norm = FusedRMSNorm(H)
    x = torch.randn(3, H)
    want = norm(x)
    assert norm._memo.token is None and norm._memo.span is not None
    lo, hi = norm._memo.span[1:3]
    assert (lo, hi) == (H, 5 * H) and torch.equal(norm(x), want)
    norm(torch.randn(4, H))
    assert norm._memo.found.call.shape[0] == 3  # M = 4 ran inside the span: no new decision
    norm(torch.randn(6, H))
    assert norm._memo.found.call.shape[0] == 6 and norm._memo.span is None


def test_a_span_with_a_capture_pick_holds_outside_a_capture_only(user_dir, monkeypatch):
    """A plain decision whose cell names another backend for CUDA-graph capture (a GPU's host-bound
    cell; made here by hand, since a CPU call has no capture pick) keeps its span for calls outside a
    capture, and a call inside one takes the capture pick."""
    import dataclasses

    _write(user_dir, {"swiglu": [_segment("pytorch"), _segment("eager", 5)]})
    real, eager = select.decision, select.backends()["eager"]
    monkeypatch.setattr(select, "decision", lambda key: dataclasses.replace(real(key), captured=eager))
    capturing = [False]
    monkeypatch.setattr(select, "capturing", lambda: capturing[0])
    m = _mlp()
    counted = Counted(m)
    _sizes(m, [(3, H), (4, H), (2, H)])
    assert m._memo.token is None and m._memo.span[4] and counted.keys == 1 and counted.plain == 3
    capturing[0] = True
    m(torch.randn(4, H))  # the capture pick runs: no plain run
    assert counted.plain == 3
    capturing[0] = False
    m(torch.randn(4, H))
    assert counted.plain == 4
