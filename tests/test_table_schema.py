"""A heuristics table is checked whole when it loads: a broken one (valid JSON, wrong types or
values) is skipped with one warning naming its file and field, and the ops keep working; a table that
loads answers every lookup. The shipped table is the slim one, without its raw points."""

import copy
import json
import math
import os
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dispatch import heuristics
from dispatch import explain, fused_bias_act_dropout, fused_linear, ops, select
from dispatch.calibrate import __main__ as calibrate_cli
from dispatch import table as table_cli
from dispatch.registry import Call

CPU = torch.device("cpu")
CPU_SLUG = heuristics.device_info(CPU)["slug"]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED = os.path.join(heuristics.SHIPPED_DIR, "nvidia-h200.json")
FAKE_GPU = {
    "type": "cuda",
    "name": "Other GPU",
    "slug": "other-gpu",
    "capability": [8, 0],
    "peak_bandwidth_gbs": 2000.0,
}


def point(m, **us):
    gpu = us or {"eager": 1.0, "triton": 0.5, "pytorch": 1.2}
    return {"m": m, "gpu_us": gpu, "host_us": {n: 2 * t for n, t in gpu.items()}, "err": {"triton": 1e-6},
            "rejected": {}, "gpu_clock": {"eager": "do_bench (capture failed: ...)"}, "drained": []}  # fmt: skip


def valid_document(device_type="cpu"):
    """A schema 2 table with every field the schema knows, as the calibrator writes it; its CPU variant
    is this machine's, so lookups use it."""
    segments = [
        {
            "m_from": 1,
            "backend": "eager",
            "runner_up": "triton",
            "margin": 0.1,
            "speedup": 1.0,
            "m": 32,
            "clock": "host",
            "gpu_backend": "triton",
            "gpu_us": {"eager": 1.0, "triton": 0.5},
            "host_us": {"eager": 2.0, "triton": 3.0},
            "pytorch_us": {"gpu": 1.2, "host": 2.0},
            "errors": {},
        },
        {
            "m_from": 48,
            "backend": "eager",
            "runner_up": None,
            "margin": None,
            "speedup": None,
            "errors": {"eager": 0.0},
        },
    ]
    common = {
        "dtype": "float32",
        "activation": "gelu",
        "mode": "training",
        "measured_as": "gelu",
        "parity_checked": True,
    }
    entries = [
        {
            **common,
            "op": "bias_act_dropout",
            "dropout": True,
            "features": [64],
            "segments": segments,
            "points": [point(1), point(32), point(64, eager=1.0)],
            "held_out": [point(8)],
            "max_m": 64,
        },
        {
            **common,
            "op": "fused_linear",
            "dropout": False,
            "features": [32, 16],
            "measured_dtype": "bfloat16",
            "segments": segments[:1],
            "points": [point(4)],
            "held_out": [],
        },
    ]
    cuda = device_type == "cuda"
    return {
        "schema_version": 2,
        "device": {
            "type": device_type,
            "name": "NVIDIA H200" if cuda else "test cpu",
            "slug": "nvidia-h200" if cuda else CPU_SLUG,
            "capability": [9, 0] if cuda else None,
            "sm_count": 132 if cuda else None,
            "peak_bandwidth_gbs": 4800.0 if cuda else None,
            "measured_bandwidth_gbs": None,
        },
        "versions": {**heuristics.running_versions(), "python": "3.12"},
        "date": "2026-01-01",
        "settings": {
            "quick": True,
            "noise": 0.03,
            "preference": ["eager", "triton"],
            "budget_s": 60.0,
            "elapsed_s": 10.0,
            "stopped_by_budget": False,
            "runs": [
                {"run": "quick", "date": "2026-01-01", "elapsed_s": 9.0, "parts": 1},
                {
                    "run": "refresh",
                    "date": "2026-01-02",
                    "elapsed_s": 1.0,
                    "families": ["fused_linear float32 training"],
                },
            ],
        },
        "backends": {"eager": "eager", "triton": "triton"},
        "entries": entries,
        "held_out_sizes": [
            {**common, "op": "bias_act_dropout", "dropout": True, "features": [96], "point": point(16)}
        ],
        "self_check": {
            "points": 2,
            "within_5pct": 1.0,
            "worst_regret": 0.0,
            "worst_vs_pytorch": None,
            "confirmed_points": 0,
        },
        "raw_points": {"file": "benchmarks/results/x.json", "moved": []},
    }


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    """An empty user directory and no shipped tables; caches cleared before and after."""
    user = tmp_path / "user"
    user.mkdir()
    monkeypatch.setenv(heuristics.ENV_DIR, str(user))
    monkeypatch.setattr(heuristics.catalog, "SHIPPED_DIR", str(tmp_path / "none"))
    assert heuristics.user_dir() == str(user)
    heuristics.reload()
    select.clear_cache()
    yield user
    heuristics.reload()
    select.clear_cache()


def run_public_ops():
    """The ops and explain() on this CPU, as a model would call them; the explain() rules."""
    heuristics.reload()
    select.clear_cache()
    x, b = torch.randn(64, 64, requires_grad=True), torch.randn(64, requires_grad=True)
    y = fused_bias_act_dropout(x, b, "gelu", 0.1)
    y.sum().backward()
    assert y.shape == (64, 64) and x.grad is not None
    xl, w, bl = torch.randn(8, 16), torch.randn(32, 16), torch.randn(32)
    torch.testing.assert_close(fused_linear(xl, w, bl, "relu"), torch.relu(xl @ w.T + bl))
    return [
        explain("fused_bias_act_dropout", x, b, "gelu", 0.1).rule,
        explain("fused_linear", xl.requires_grad_(), w, bl, "gelu").rule,
        heuristics.describe(CPU),
    ]


def heuristics_warnings(caught):
    return [str(w.message) for w in caught if issubclass(w.category, heuristics.HeuristicsWarning)]


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


def set_at(path, value):
    """A mutation of valid_document(): the field at ``path`` (keys and indices) set to ``value``,
    or removed when ``value`` is DELETE."""

    def mutate(doc):
        *parents, last = path
        node = doc
        for k in parents:
            node = node[k]
        if value is DELETE:
            del node[last]
        else:
            node[last] = copy.deepcopy(value)
        return doc

    return mutate


DELETE = object()
E0, S0 = ("entries", 0), ("entries", 0, "segments", 0)
BROKEN = {  # id: (mutation, what the warning says)
    "slug-list": (set_at(("device", "slug"), [CPU_SLUG]), "device.slug must be a string, got list"),
    "slug-empty": (set_at(("device", "slug"), ""), "device.slug must be a non-empty string"),
    "versions-list": (set_at(("versions",), []), "versions must be an object, got list"),
    "version-int": (set_at(("versions", "torch"), 2), "versions.torch must be a string, got int"),
    "huge-feature": (
        set_at((*E0, "features"), [10**400]),
        "entries[0].features[0] must be an integer from 1 to 2**62, got an integer of 401 digits",
    ),
    "feature-str": (set_at((*E0, "features"), ["64"]), "entries[0].features[0] must be an integer, got str"),
    "feature-bool": (
        set_at((*E0, "features"), [True]),
        "entries[0].features[0] must be an integer, got bool",
    ),
    "feature-float": (
        set_at((*E0, "features"), [64.0]),
        "entries[0].features[0] must be an integer, got float",
    ),
    "feature-zero": (set_at((*E0, "features"), [0]), "entries[0].features[0] must be an integer from 1"),
    "feature-negative": (
        set_at((*E0, "features"), [-64]),
        "entries[0].features[0] must be an integer from 1",
    ),
    "feature-count": (set_at((*E0, "features"), [64, 64]), "entries[0].features must hold 1 item, got 2"),
    "features-dict": (set_at((*E0, "features"), {"n": 64}), "entries[0].features must be a list, got dict"),
    "m-from-str": (set_at((*S0, "m_from"), "1"), "entries[0].segments[0].m_from must be an integer, got str"),
    "m-from-zero": (set_at((*S0, "m_from"), 0), "entries[0].segments[0].m_from must be an integer from 1"),
    "m-from-order": (
        set_at(("entries", 0, "segments", 1, "m_from"), 1),
        "entries[0].segments[1].m_from must be above",
    ),
    "margin-nan": (
        set_at((*S0, "margin"), math.nan),
        "entries[0].segments[0].margin must be a finite number above -1, got nan",
    ),
    "margin-inf": (
        set_at((*S0, "margin"), math.inf),
        "entries[0].segments[0].margin must be a finite number",
    ),
    "margin-str": (set_at((*S0, "margin"), "big"), "entries[0].segments[0].margin must be a number, got str"),
    "margin-bool": (
        set_at((*S0, "margin"), True),
        "entries[0].segments[0].margin must be a number, got bool",
    ),
    "margin-below-minus-1": (
        set_at((*S0, "margin"), -1.5),
        "entries[0].segments[0].margin must be a finite number above -1",
    ),
    "speedup-zero": (
        set_at((*S0, "speedup"), 0),
        "entries[0].segments[0].speedup must be a finite number above 0",
    ),
    "error-negative": (
        set_at((*S0, "errors"), {"eager": -1}),
        "entries[0].segments[0].errors.eager must be a finite number of at least 0",
    ),
    "backend-int": (set_at((*S0, "backend"), 3), "entries[0].segments[0].backend must be a string, got int"),
    "backend-null": (
        set_at((*S0, "backend"), None),
        "entries[0].segments[0].backend must be a string, got null",
    ),
    "backend-missing": (set_at((*S0, "backend"), DELETE), "entries[0].segments[0].backend is missing"),
    "runner-up-list": (
        set_at((*S0, "runner_up"), ["triton"]),
        "entries[0].segments[0].runner_up must be a string, got list",
    ),
    "segments-empty": (set_at((*E0, "segments"), []), "entries[0].segments must not be empty"),
    "segments-dict": (set_at((*E0, "segments"), {}), "entries[0].segments must be a list, got dict"),
    "segment-str": (set_at(S0, "eager"), "entries[0].segments[0] must be an object, got str"),
    "entry-str": (set_at(E0, "x"), "entries[0] must be an object, got str"),
    "entries-dict": (set_at(("entries",), {}), "entries must be a list, got dict"),
    "entries-missing": (set_at(("entries",), DELETE), "entries is missing"),
    "op-missing": (set_at((*E0, "op"), DELETE), "entries[0].op is missing"),
    "op-unknown": (
        set_at((*E0, "op"), "matmul"),
        f'entries[0].op must be {" or ".join(map(json.dumps, ops.names()))}, got "matmul"',  # the known ops
    ),
    "dtype-int8": (set_at((*E0, "dtype"), "int8"), "entries[0].dtype must be a floating-point dtype's name"),
    "dtype-nonsense": (
        set_at((*E0, "dtype"), "__class__"),
        "entries[0].dtype must be a floating-point dtype's name",
    ),
    "mode": (
        set_at((*E0, "mode"), "train"),
        'entries[0].mode must be "inference" or "training", got "train"',
    ),
    "dropout-missing": (set_at((*E0, "dropout"), DELETE), "entries[0].dropout is missing"),
    "dropout-str": (set_at((*E0, "dropout"), "yes"), "entries[0].dropout must be true or false, got str"),
    "measured-as-int": (set_at((*E0, "measured_as"), 5), "entries[0].measured_as must be a string, got int"),
    "max-m-zero": (set_at((*E0, "max_m"), 0), "entries[0].max_m must be an integer from 1"),
    "max-m-str": (set_at((*E0, "max_m"), "64"), "entries[0].max_m must be an integer, got str"),
    "point-m-negative": (
        set_at((*E0, "points", 0, "m"), -1),
        "entries[0].points[0].m must be an integer from 1",
    ),
    "point-gpu-us-zero": (
        set_at((*E0, "points", 0, "gpu_us", "eager"), 0),
        "entries[0].points[0].gpu_us.eager must be a finite number above 0",
    ),
    "point-host-us-missing": (
        set_at((*E0, "points", 0, "host_us"), DELETE),
        "entries[0].points[0].host_us is missing",
    ),
    "point-schema-1-ms": (  # a schema 1 point in a schema 2 table
        set_at((*E0, "points", 0), {"m": 1, "ms": {"eager": 1.0}}),
        "entries[0].points[0].gpu_us is missing",
    ),
    "point-gpu-clock-int": (
        set_at((*E0, "points", 0, "gpu_clock", "eager"), 1),
        "entries[0].points[0].gpu_clock.eager must be a string, got int",
    ),
    "point-drained-str": (
        set_at((*E0, "points", 0, "drained"), "eager"),
        "entries[0].points[0].drained must be a list, got str",
    ),
    "segment-clock-other": (
        set_at((*S0, "clock"), "cpu"),
        'entries[0].segments[0].clock must be "gpu" or "host", got "cpu"',
    ),
    "segment-gpu-us-negative": (
        set_at((*S0, "gpu_us", "eager"), -1.0),
        "entries[0].segments[0].gpu_us.eager must be a finite number above 0",
    ),
    "segment-host-us-str": (
        set_at((*S0, "host_us"), "2 us"),
        "entries[0].segments[0].host_us must be an object, got str",
    ),
    "segment-pytorch-host-missing": (
        set_at((*S0, "pytorch_us", "host"), DELETE),
        "entries[0].segments[0].pytorch_us.host is missing",
    ),
    "segment-gpu-backend-int": (
        set_at((*S0, "gpu_backend"), 2),
        "entries[0].segments[0].gpu_backend must be a string, got int",
    ),
    "segment-m-zero": (set_at((*S0, "m"), 0), "entries[0].segments[0].m must be an integer from 1"),
    "measured-dtype-int8": (
        set_at(("entries", 1, "measured_dtype"), "int8"),
        "entries[1].measured_dtype must be a floating-point dtype's name",
    ),
    "points-dict": (set_at((*E0, "points"), {}), "entries[0].points must be a list, got dict"),
    "held-out-gpu-us-list": (
        set_at((*E0, "held_out", 0, "gpu_us"), []),
        "entries[0].held_out[0].gpu_us must be an object, got list",
    ),
    "held-out-size-features": (
        set_at(("held_out_sizes", 0, "features"), []),
        "held_out_sizes[0].features must hold 1 item, got 0",
    ),
    "held-out-size-point": (
        set_at(("held_out_sizes", 0, "point"), None),
        "held_out_sizes[0].point must be an object, got null",
    ),
    "schema-version-bool": (set_at(("schema_version",), True), "schema_version must be an integer, got bool"),
    "schema-version-other": (set_at(("schema_version",), 3), "schema_version 3, this code reads 1 and 2"),
    "schema-version-missing": (set_at(("schema_version",), DELETE), "schema_version is missing"),
    "device-str": (set_at(("device",), "cpu"), "device must be an object, got str"),
    "device-missing": (set_at(("device",), DELETE), "device is missing"),
    "device-name-missing": (set_at(("device", "name"), DELETE), "device.name is missing"),
    "capability-one": (set_at(("device", "capability"), [9]), "device.capability must hold 2 items, got 1"),
    "capability-str": (
        set_at(("device", "capability"), ["9", "0"]),
        "device.capability[0] must be an integer, got str",
    ),
    "bandwidth-negative": (
        set_at(("device", "peak_bandwidth_gbs"), -1.0),
        "device.peak_bandwidth_gbs must be a finite number above 0",
    ),
    "date-int": (set_at(("date",), 20260101), "date must be a string, got int"),
    "noise-str": (set_at(("settings", "noise"), "3%"), "settings.noise must be a number, got str"),
    "run-elapsed-str": (
        set_at(("settings", "runs", 0, "elapsed_s"), "9 s"),
        "settings.runs[0].elapsed_s must be a number, got str",
    ),
    "refresh-families-missing": (
        set_at(("settings", "runs", 1, "families"), DELETE),
        "settings.runs[1].families is missing",
    ),
    "preference-int": (
        set_at(("settings", "preference"), [1]),
        "settings.preference[0] must be a string, got int",
    ),
    "backend-label-int": (set_at(("backends", "eager"), 1), "backends.eager must be a string, got int"),
    "self-check-share-str": (
        set_at(("self_check", "within_5pct"), "99%"),
        "self_check.within_5pct must be a number, got str",
    ),
    "self-check-share-null": (
        set_at(("self_check", "within_5pct"), None),
        "self_check.within_5pct must be a number, got null",
    ),
    "self-check-regret-missing": (
        set_at(("self_check", "worst_regret"), DELETE),
        "self_check.worst_regret is missing",
    ),
    "raw-points-str": (set_at(("raw_points",), "x.json"), "raw_points must be an object, got str"),
    "document-list": (lambda doc: [doc], "a table must be a JSON object, got list"),
}


@pytest.mark.parametrize("case", list(BROKEN), ids=list(BROKEN))
def test_broken_table_is_skipped_with_one_warning_and_the_ops_work(user_dir, case):
    mutate, message = BROKEN[case]
    path = user_dir / "t.json"
    path.write_text(json.dumps(mutate(valid_document())))  # NaN and Infinity as Python's json writes them
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rules = run_public_ops()
    msgs = heuristics_warnings(caught)
    assert len(msgs) == 1, msgs
    # the file, then the field and what is wrong with it (the expected text is the reason's start)
    assert msgs[0].startswith(f"ignoring heuristics table {path}: {message}"), msgs[0]
    assert all("no calibrated table" in r for r in rules), rules  # the default decided, not the table


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
    for op, features in (("bias_act_dropout", [(64,), (1000,)]), ("fused_linear", [(32, 16), (5, 7000)])):
        for f in features:
            for m in (1, 47, 48, 10**7):
                for training in (False, True):
                    out.append(
                        Call(op, CPU, torch.float32, (m, *f), "gelu", op == "bias_act_dropout", training)
                    )
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


def test_calibrate_will_not_resume_a_slim_table():
    info = heuristics.device_info(CPU)
    with pytest.raises(
        SystemExit,
        match="keeps no raw measured points; run on benchmarks/results/calibrate_points-nvidia-h200.json",
    ):
        calibrate_cli._previous(SHIPPED, info)
