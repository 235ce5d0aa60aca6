"""A heuristics table is checked whole when it loads: the valid table and a schema 1 table load
silently and decide; an unreadable file, like any random mutation that breaks the schema, is skipped
with one warning naming its file, and a table that loads answers every lookup. The shipped table is the
slim one, without its raw points. (One case per broken field: test_table_broken.py.)"""

import json
import os
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dispatch import heuristics
from dispatch.calibrate import __main__ as calibrate_cli
from dispatch import table as table_cli
from dispatch import ops
from dispatch.registry import Call
from table_docs import CPU, CPU_SLUG, DELETE, heuristics_warnings, run_public_ops, set_at, valid_document

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED = os.path.join(heuristics.SHIPPED_DIR, "nvidia-h200.json")
FAKE_GPU = {
    "type": "cuda",
    "name": "Other GPU",
    "slug": "other-gpu",
    "capability": [8, 0],
    "peak_bandwidth_gbs": 2000.0,
}


def test_the_valid_document_loads_silently_and_decides(user_dir):
    path = user_dir / "t.json"
    path.write_text(json.dumps(valid_document()))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rules = run_public_ops()
    assert heuristics_warnings(caught) == []
    assert all(str(path) in r for r in rules) and "heuristics table" in rules[0], rules
    linear = rules[1]  # fused_linear 8 x 32 x 16: the first segment, which keeps its clocks
    assert "host-bound: host cost 2.0 us exceeds GPU time 1.0 us at M=32" in linear, linear
    assert "by GPU time alone triton" in linear and "1.00x plain PyTorch" in linear, linear
    assert "timings shared with gelu bfloat16" in linear, linear


def schema_1(doc):
    """``doc`` as the calibrator wrote it before the host clock: one time per backend and point (ms),
    segments without clocks, the self-check against eager."""
    for e in doc["entries"]:
        e.pop("measured_dtype", None)
        for p in e["points"] + e["held_out"]:
            p["ms"] = {n: t / 1e3 for n, t in p.pop("gpu_us").items() if n != "pytorch"}
            for key in ("host_us", "gpu_clock", "drained"):
                p.pop(key)
        e["segments"] = [{k: v for k, v in seg.items() if k in ("m_from", "backend", "runner_up", "margin",
                         "speedup", "errors")} for seg in e["segments"]]  # fmt: skip
    doc["held_out_sizes"][0]["point"] = {"m": 16, "ms": {"eager": 1.0}}
    doc["self_check"]["worst_vs_eager"] = doc["self_check"].pop("worst_vs_pytorch")
    return {**doc, "schema_version": 1}


def test_a_schema_1_table_loads_silently_and_decides_as_before(user_dir):
    path = user_dir / "t.json"
    path.write_text(json.dumps(schema_1(valid_document())))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rules = run_public_ops()
        table = heuristics.load_table(str(path))
    assert heuristics_warnings(caught) == [] and table.version == 1
    assert "heuristics table" in rules[0] and "GPU" not in rules[0] and "PyTorch" not in rules[0], rules
    printed = table_cli.render(table)
    assert "speedup over eager" in printed and "worst vs eager" in printed, printed
    bad = schema_1(valid_document())
    bad["entries"][0]["points"][0]["ms"]["eager"] = -1
    path.write_text(json.dumps(bad))
    with pytest.warns(
        heuristics.HeuristicsWarning, match="entries\\[0\\].points\\[0\\].ms.eager must be a finite"
    ):
        assert heuristics.load_table(str(path)) is None


def test_an_unreadable_file_names_the_json_error(user_dir):
    path = user_dir / "t.json"
    path.write_text(json.dumps(valid_document())[:-20])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_public_ops()
    msgs = heuristics_warnings(caught)
    assert len(msgs) == 1 and msgs[0].startswith(f"ignoring heuristics table {path}: JSONDecodeError"), msgs


# ----------------------------------------------------------------------------- random mutations


def all_paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from all_paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from all_paths(v, (*prefix, i))


# values the schema expects somewhere, so that mutations also make valid tables of other shapes
NEAR_VALID = st.sampled_from(
    "cuda cpu training inference float32 bfloat16 eager triton gelu bias_act_dropout fused_linear".split()
    + ["refresh", CPU_SLUG, 0, 1, 2, -1, 2**62, 2**62 + 1, 10**400, 1.5, -0.5, [9, 0], [1], [64, 32]]
)


SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**500), max_value=10**500)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8)
    | NEAR_VALID
)


JSON_VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


def calls():
    """Calls on the keys of valid_document()'s entries, at measured and unmeasured sizes, M from 1 to
    far beyond what was measured, both modes."""
    out = []
    traits = {"bias_act_dropout": dict(activation="gelu", dropout=True), "fused_linear": dict(activation="gelu")}
    for op, features in (("bias_act_dropout", [(64,), (1000,)]), ("fused_linear", [(32, 16), (5, 7000)])):
        for f in features:
            for m in (1, 47, 48, 10**7):
                for training in (False, True):
                    out.append(ops.get(op).call(CPU, torch.float32, (m, *f), training, **traits[op]))
    return out


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data(), device_type=st.sampled_from(["cpu", "cuda"]))
def test_random_mutations_load_and_answer_or_are_skipped_with_a_warning(user_dir, data, device_type):
    doc = valid_document(device_type)
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        path = data.draw(st.sampled_from(list(all_paths(doc))[1:]), label="path")
        delete = data.draw(st.booleans(), label="delete")
        value = DELETE if delete else data.draw(JSON_VALUES, label="value")
        try:
            set_at(path, value)(doc)
        except (KeyError, IndexError, TypeError):  # an earlier mutation removed or replaced its parent
            pass
    file = user_dir / "t.json"
    file.write_text(json.dumps(doc))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        table = heuristics.load_table(str(file))
        msgs = heuristics_warnings(caught)
        if table is None:
            assert len(msgs) == 1 and msgs[0].startswith(f"ignoring heuristics table {file}: "), msgs
        else:
            assert msgs == [], msgs
            for call in calls():
                choice = table.choose(call)
                assert choice is None or (choice.backend and str(file) in choice.description), choice
            assert isinstance(table.version_mismatch(), list)
            heuristics.resolve(heuristics.device_info(CPU), (table,))
            heuristics.resolve(FAKE_GPU, (table,))  # the nearest-GPU distance, for a cuda table
            assert "activation" in table_cli.render(table) or not table.index
        rules = run_public_ops()  # through the user directory, as a model meets the table
    assert all(isinstance(r, str) for r in rules)


# ----------------------------------------------------------------------------- the shipped table


def test_the_shipped_table_loads_silently_and_keeps_no_points():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        table = heuristics.load_table(SHIPPED)
    assert table is not None and table.slug == "nvidia-h200" and len(table.index) > 100
    doc = table.data
    assert "held_out_sizes" not in doc and "series_seconds" not in doc["settings"]
    assert all(
        "points" not in e and "held_out" not in e and e["max_m"] >= e["segments"][-1]["m_from"]
        for e in doc["entries"]
    )
    # its own self-check on >= 100 held-out points: >= 95% of picks within 5% of the fastest (the table
    # misses its worst-case targets at host-bound sizes, where plain PyTorch's launches are cheaper than
    # any backend's call: benchmarks/PERF.md)
    check = doc["self_check"]
    assert check["points"] >= 100 and check["within_5pct"] >= 0.95 and not check["pick_not_runnable"]
    assert doc["date"] and doc["versions"]["torch"]
    # schema 2 keeps both clocks of winner, runner-up and PyTorch per segment: ~300 bytes a segment
    assert os.path.getsize(SHIPPED) < 1_000_000


def test_the_shipped_table_is_its_raw_file_slimmed_and_answers_alike():
    shipped = heuristics.load_table(SHIPPED)
    raw_file = shipped.data["raw_points"]["file"]
    with open(os.path.join(REPO, raw_file)) as f:
        raw_doc = json.load(f)
    assert heuristics.slim(raw_doc, raw_file) == shipped.data
    raw = heuristics.Table(raw_doc, SHIPPED)  # one path, so that the descriptions compare
    assert all(e["points"] for e in raw_doc["entries"])
    checked = 0
    for e in raw_doc["entries"][::7]:
        ms = {1, e["max_m"] if "max_m" in e else 1, 10**6} | {
            s["m_from"] + d for s in e["segments"] for d in (-1, 0, 1)
        }
        for m in sorted(ms - {0}):
            for f in (tuple(e["features"]), tuple(2 * x + 1 for x in e["features"])):
                call = Call(
                    e["op"],
                    CPU,
                    getattr(torch, e["dtype"]),
                    (m, *f),
                    e["activation"],
                    e["dropout"],
                    e["mode"] == "training",
                )
                assert raw.choose(call) == shipped.choose(call), call
                checked += 1
    assert checked > 300


def test_the_table_printer_reads_the_slim_table():
    printed = table_cli.render(
        heuristics.load_table(SHIPPED), op="fused_linear", dtype="bfloat16", mode="inference"
    )
    assert (
        "fused_linear  bfloat16  inference" in printed
        and ">=" in printed
        and "raw measured points: benchmarks/results/" in printed
    )


def test_calibrate_will_not_resume_a_slim_table(user_dir):
    """``--resume`` over a shipped (slim) table stops before measuring, naming its raw points' file, and
    leaves the table as it was."""
    out = user_dir / "slim.json"
    with open(SHIPPED, encoding="utf-8") as f:
        out.write_text(f.read())
    before = out.read_text()
    with pytest.raises(
        SystemExit,
        match="--resume: .*slim.json keeps no raw measured points; run on "
        "benchmarks/results/calibrate_points-nvidia-h200.json",
    ):
        calibrate_cli.main(["--resume", "--quick", "--ops", "bias_act_dropout", "--out", str(out)])
    assert out.read_text() == before
