"""A broken heuristics table (valid JSON, wrong types or values) is skipped with one warning naming its
file and field, and the ops keep working: one case per field and fault, each a mutation of the valid
table."""

import json
import math
import warnings

import pytest

from dispatch import ops
from table_docs import CPU_SLUG, DELETE, heuristics_warnings, run_public_ops, set_at, valid_document

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
