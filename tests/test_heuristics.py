"""Heuristic tables: round trip, atomic write, bad tables, GPU matching, precedence, crossover lookup,
interpolation between measured sizes (schema 2), and schema 1 tables answering as they always did."""

import json
import os
import time
import warnings

import pytest
import torch

from dispatch import heuristics
from dispatch import explain, select
from dispatch import ops
from harness import eager_twin, register

CPU = torch.device("cpu")
CPU_SLUG = heuristics.device_info(CPU)["slug"]


def segments(*cuts, version=2):
    """[(m_from, backend), ...] -> the table's segment dicts (schema 2: with both clocks)."""
    out = []
    for m, b in cuts:
        seg = {
            "m_from": m,
            "backend": b,
            "runner_up": "eager",
            "margin": 0.1,
            "speedup": 1.2,
            "errors": {b: 1e-7},
        }
        if version >= 2:
            seg.update(m=max(m, 2), clock="gpu", gpu_backend=b, gpu_us={b: 120.0, "eager": 132.0},
                       host_us={b: 40.0, "eager": 30.0}, pytorch_us={"gpu": 140.0, "host": 30.0})  # fmt: skip
        out.append(seg)
    return out


def raw_point(m, version=2):
    if version == 1:
        return {"m": m, "ms": {"eager": 1.0}, "err": {}, "rejected": {}}
    return {
        "m": m,
        "gpu_us": {"eager": 1.0, "pytorch": 1.1},
        "host_us": {"eager": 2.0, "pytorch": 2.0},
        "err": {},
    }


def entry(
    cuts,
    op="bias_act_dropout",
    features=(4096,),
    activation="gelu",
    dtype="float32",
    mode="training",
    dropout=True,
    points=(1, 64, 96, 4096),
    version=2,
):
    return {
        "op": op,
        "dtype": dtype,
        "activation": activation,
        "mode": mode,
        "dropout": dropout,
        "features": list(features),
        "measured_as": activation,
        "parity_checked": True,
        "segments": segments(*cuts, version=version),
        "points": [raw_point(m, version) for m in points],
        "held_out": [],
    }


def document(
    entries, slug=CPU_SLUG, device_type="cpu", capability=None, versions=None, name="test device", version=2
):
    return {
        "schema_version": version,
        "device": {
            "type": device_type,
            "name": name,
            "slug": slug,
            "capability": capability,
            "peak_bandwidth_gbs": None,
        },
        "versions": versions or heuristics.running_versions(),
        "date": "2026-01-01",
        "settings": {},
        "entries": entries,
    }


@pytest.fixture
def dirs(tmp_path, monkeypatch):
    """Empty user and shipped directories; caches cleared before and after."""
    user, shipped = tmp_path / "user", tmp_path / "shipped"
    user.mkdir()
    shipped.mkdir()
    monkeypatch.setenv(heuristics.ENV_DIR, str(user))
    monkeypatch.setattr(heuristics.catalog, "SHIPPED_DIR", str(shipped))
    heuristics.reload()
    select.clear_cache()
    yield user, shipped
    heuristics.reload()
    select.clear_cache()


def bad_call(m, n=4096, activation="gelu", dtype=torch.float32, training=True, dropout=True, device=CPU):
    spec = ops.get("bias_act_dropout")
    return spec.call(device, dtype, (m, n), training, activation=activation, dropout=dropout)


def test_slugs():
    assert heuristics.slugify("NVIDIA H200") == "nvidia-h200"
    assert heuristics.slugify("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert CPU_SLUG.startswith("cpu-")


def test_round_trip(dirs):
    user, _ = dirs
    doc = document([entry([(1, "eager"), (300, "nvfuser")])])
    path = heuristics.save_table(doc, str(user / f"{CPU_SLUG}.json"))
    with open(path) as f:
        assert json.load(f) == doc
    table = heuristics.load_table(path)
    assert table.slug == CPU_SLUG and table.data == doc
    assert heuristics.lookup(bad_call(300)).backend == "nvfuser"
    assert heuristics.lookup(bad_call(299)).backend == "eager"


def test_atomic_write_leaves_old_file(tmp_path):
    path = tmp_path / "t.json"
    heuristics.save_table({"a": 1}, str(path))
    for bad in ({"a": {1, 2}}, {"a": float("nan")}):  # not JSON: a set; NaN (allow_nan=False)
        with pytest.raises((TypeError, ValueError)):
            heuristics.save_table(bad, str(path))
        assert json.loads(path.read_text()) == {"a": 1}
        assert os.listdir(tmp_path) == ["t.json"]  # no temporary file left behind


@pytest.mark.parametrize(
    "content",
    [
        "{ not json",
        json.dumps({"schema_version": 999, "device": {"slug": CPU_SLUG}, "entries": []}),
        json.dumps(document([entry([(5, "eager"), (3, "triton")])])),  # segments out of order
        json.dumps(document([{"op": "bias_act_dropout"}])),  # missing fields
        json.dumps(document([entry([(1, "eager")], features=(0,))])),  # a size lookup cannot use
        json.dumps(
            document(
                [{**entry([(1, "eager")]), "segments": [{"m_from": 1, "backend": "x", "margin": "big"}]}]
            )
        ),
    ],
)
def test_corrupt_table_is_ignored_with_a_warning(dirs, content):
    user, _ = dirs
    (user / f"{CPU_SLUG}.json").write_text(content)
    with pytest.warns(heuristics.HeuristicsWarning, match="ignoring heuristics table"):
        assert heuristics.lookup(bad_call(64)) is None
    assert "no calibrated table" in heuristics.describe(CPU)


def test_gpu_without_its_own_table_runs_plain_pytorch(dirs, monkeypatch):
    """Another GPU's table is never borrowed: its crossovers can lose to plain PyTorch here. No table,
    no warning; describe() names the tables there are and the command that builds one."""
    _, shipped = dirs
    for slug, cap, backend in (("gpu-a", [9, 0], "triton"), ("gpu-b", [8, 0], "inductor")):
        doc = document([entry([(1, backend)])], slug=slug, device_type="cuda", capability=cap, name=slug)
        heuristics.save_table(doc, str(shipped / f"{slug}.json"))
    fake = {"type": "cuda", "name": "Some GPU", "slug": "some-gpu", "capability": [8, 0], "peak_bandwidth_gbs": None}
    monkeypatch.setattr(heuristics.catalog, "device_info", lambda device: fake)
    cuda = torch.device("cuda", 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert all(heuristics.lookup(bad_call(m, device=cuda)) is None for m in (1, 2, 3))
        said = heuristics.describe(cuda)
    assert "Some GPU" in said and "plain PyTorch" in said and "gpu-a, gpu-b" in said
    assert heuristics.CALIBRATE_HINT in said


def test_cpu_without_table_is_none_and_silent(dirs):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert heuristics.lookup(bad_call(64)) is None


def test_version_mismatch_loads_with_a_warning(dirs):
    user, _ = dirs
    doc = document([entry([(1, "nvfuser")])], versions={"torch": "0.1", "triton": None, "cuda": None})
    heuristics.save_table(doc, str(user / "t.json"))
    with pytest.warns(heuristics.HeuristicsWarning, match="torch 0.1"):
        assert heuristics.lookup(bad_call(64)).backend == "nvfuser"


def test_user_table_takes_precedence(dirs):
    user, shipped = dirs
    heuristics.save_table(document([entry([(1, "nvfuser")])]), str(shipped / f"{CPU_SLUG}.json"))
    assert heuristics.lookup(bad_call(64)).backend == "nvfuser"
    heuristics.save_table(document([entry([(1, "inductor")])]), str(user / f"{CPU_SLUG}.json"))
    heuristics.reload()
    choice = heuristics.lookup(bad_call(64))
    assert choice.backend == "inductor" and str(user) in choice.description


def test_crossovers_decide_between_measured_sizes(dirs):
    user, _ = dirs
    heuristics.save_table(
        document([entry([(1, "eager"), (80, "triton"), (3000, "inductor")])]), str(user / "t.json")
    )
    expected = {
        1: "eager",
        79: "eager",
        80: "triton",
        95: "triton",
        2999: "triton",
        3000: "inductor",
        10**6: "inductor",
    }
    for m, backend in expected.items():
        assert heuristics.lookup(bad_call(m)).backend == backend, m
    assert "M in [80, 3000)" in heuristics.lookup(bad_call(100)).description
    assert "beyond the largest measured M=4096" in heuristics.lookup(bad_call(10**6)).description
    # other keys are not in the table
    assert heuristics.lookup(bad_call(100, training=False)) is None
    assert heuristics.lookup(bad_call(100, dropout=False)) is None
    assert heuristics.lookup(bad_call(100, dtype=torch.bfloat16)) is None
    assert heuristics.lookup(bad_call(100, activation="relu")) is None


def test_schema_1_takes_the_nearest_feature_size(dirs):
    """A schema 1 table (the shipped H200 table until it is recalibrated) answers as it always did."""
    user, _ = dirs
    entries = [
        entry([(1, "eager")], features=(1024,), version=1),
        entry([(1, "nvfuser")], features=(8192,), version=1),
        entry([(1, "eager")], op="fused_linear", features=(4096, 1024), dropout=False, version=1),
        entry([(1, "inductor")], op="fused_linear", features=(1024, 4096), dropout=False, version=1),
    ]
    heuristics.save_table(document(entries, version=1), str(user / "t.json"))
    choice = heuristics.lookup(bad_call(16, n=3000))  # log2: 1.55 from 1024, 1.45 from 8192
    assert choice.description.endswith(
        "bias_act_dropout float32 gelu training, the segment M in [1, inf); nearest measured size 8192 "
        "(3000 not measured); runner-up eager by +10%"
    ), choice.description
    assert choice.backend == "nvfuser" and "GPU" not in choice.description
    assert heuristics.lookup(bad_call(16, n=1024)).backend == "eager"
    linear = ops.get("fused_linear").call(CPU, torch.float32, (16, 1100, 3000), True, activation="gelu")
    assert heuristics.lookup(linear).backend == "inductor"


def test_schema_2_interpolates_crossovers_between_measured_sizes(dirs):
    """Between two measured sizes whose segments name the same backends, each crossover is interpolated
    in log space; where they differ, the nearer size decides; outside them, the nearest. The
    description says which."""
    user, _ = dirs
    entries = [
        entry([(1, "eager"), (100, "triton")], features=(1024,)),
        entry([(1, "eager"), (400, "triton")], features=(4096,)),
        entry([(1, "nvfuser")], features=(16384,)),
    ]
    heuristics.save_table(document(entries), str(user / "t.json"))
    assert heuristics.lookup(bad_call(199, n=2048)).backend == "eager"  # halfway in log2: M = 200
    choice = heuristics.lookup(bad_call(200, n=2048))
    assert choice.backend == "triton", choice.description
    assert "between measured 1024 and 4096 (2048 at 0.50 of the way): crossovers interpolated in log " \
           "space at M=200" in choice.description  # fmt: skip
    assert heuristics.lookup(bad_call(100, n=1024)).backend == "triton"  # a measured size: its own cut
    choice = heuristics.lookup(bad_call(5000, n=10000))  # 0.72 of the way from 4096 to 16384
    assert choice.backend == "nvfuser" and "whose choices differ: the nearer 16384" in choice.description
    choice = heuristics.lookup(bad_call(5000, n=512))
    assert (
        choice.backend == "triton"
        and "nearest measured size 1024 (512 not measured), outside" in choice.description
    )


def test_explain_names_the_clock_and_the_speedup_over_pytorch(dirs, monkeypatch):
    user, _ = dirs
    register(monkeypatch, eager_twin("fake"))
    e = entry([(1, "eager"), (32, "fake")])
    e["segments"][0].update(clock="host", m=8, gpu_us={"eager": 9.5}, host_us={"eager": 31.0})
    heuristics.save_table(document([e]), str(user / "t.json"))
    x, b = torch.randn(64, 4096, requires_grad=True), torch.randn(4096, requires_grad=True)
    text = str(explain("fused_bias_act_dropout", x, b, "gelu", 0.1))
    assert "runs on: fake" in text and "the cheapest by max(GPU time, host cost)" in text, text
    assert (
        "GPU-bound: GPU time 120 us > host 40 us at M=32" in text
        and "at worst 1.20x plain PyTorch over the segment; PyTorch 140 us at M=32" in text
    )
    text = str(explain("fused_bias_act_dropout", x[:8], b, "gelu", 0.1))
    assert (
        "runs on: eager" in text and "host-bound: host cost 31 us exceeds GPU time 9.5 us at M=8" in text
    ), text


def test_dispatcher_follows_the_table(dirs, monkeypatch):
    user, _ = dirs
    register(monkeypatch, eager_twin("fake"))
    heuristics.save_table(document([entry([(1, "eager"), (32, "fake")])]), str(user / "t.json"))
    x, b = torch.randn(64, 4096, requires_grad=True), torch.randn(4096, requires_grad=True)
    decision = explain("fused_bias_act_dropout", x, b, "gelu", 0.1)
    assert decision.backend.name == "fake" and "heuristics table" in decision.rule
    assert explain("fused_bias_act_dropout", x[:8], b, "gelu", 0.1).backend.name == "eager"


def test_cached_lookup_is_cheap(dirs):
    user, _ = dirs
    heuristics.save_table(document([entry([(1, "eager"), (80, "triton")])]), str(user / "t.json"))
    call = bad_call(100)
    heuristics.lookup(call)
    start = time.perf_counter()
    for _ in range(10000):
        heuristics.lookup(call)
    assert (time.perf_counter() - start) / 10000 < 3e-6 * 5  # an lru_cache hit; generous for loaded CI


def test_saved_table_is_readable_one_segment_a_line(tmp_path):
    doc = document([entry([(1, "eager"), (80, "triton"), (3000, "inductor")])])
    path = heuristics.save_table(doc, str(tmp_path / "t.json"))
    with open(path) as f:
        text = f.read()
    assert json.loads(text) == doc
    lines = [line.strip().rstrip(",") for line in text.splitlines()]
    for record in doc["entries"][0]["segments"] + doc["entries"][0]["points"]:
        assert json.dumps(record) in lines  # each on a line of its own
    # a schema 2 segment (both clocks of winner, runner-up and PyTorch) is ~300 characters on its line
    assert max(map(len, text.splitlines())) < 400 and len(lines) < 40


def test_max_m_marks_calls_past_it_without_points(dirs):
    user, _ = dirs
    e = {k: v for k, v in entry([(1, "eager"), (80, "triton")]).items() if k not in ("points", "held_out")}
    heuristics.save_table(document([{**e, "max_m": 5000}]), str(user / "t.json"))
    assert "beyond the largest" not in heuristics.lookup(bad_call(5000)).description
    assert "beyond the largest measured M=5000" in heuristics.lookup(bad_call(5001)).description
    heuristics.save_table(document([e]), str(user / "t.json"))  # neither: where the last segment starts
    heuristics.reload()
    assert "beyond the largest measured M=80" in heuristics.lookup(bad_call(81)).description


def test_slim_drops_the_raw_points_and_answers_alike():
    entries = [
        entry([(1, "eager"), (80, "triton")], points=(1, 64, 96, 7000)),
        entry([(1, "nvfuser")], op="fused_linear", features=(64, 32), dropout=False, points=(2, 8)),
    ]
    doc = {
        **document(entries),
        "settings": {"series_seconds": [{"series": "x"}], "noise": 0.03},
        "held_out_sizes": [{**entries[0], "point": entries[0]["points"][0]}],
    }
    slim = heuristics.slim(doc, "results/raw.json")
    assert "held_out_sizes" not in slim and slim["settings"] == {"noise": 0.03}
    assert [e["max_m"] for e in slim["entries"]] == [7000, 8]
    assert all("points" not in e and "held_out" not in e for e in slim["entries"])
    assert (
        slim["raw_points"]["file"] == "results/raw.json" and "held_out_sizes" in slim["raw_points"]["moved"]
    )
    assert doc["entries"][0]["points"]  # the calibrator's document is left whole
    full, thin = heuristics.Table(doc, "t"), heuristics.Table(slim, "t")
    for m in (1, 79, 80, 7000, 7001, 10**6):
        for n in (4096, 100):
            assert full.choose(bad_call(m, n=n)) == thin.choose(bad_call(m, n=n))
        linear = ops.get("fused_linear").call(CPU, torch.float32, (m, 64, 32), True, activation="gelu")
        assert full.choose(linear) == thin.choose(linear) and full.choose(linear).backend == "nvfuser"
    assert "beyond the largest measured M=7000" in thin.choose(bad_call(7001)).description


def test_explain_says_not_measured_where_the_budget_cut_a_family(dirs):
    """A table without the call's cell: explain() says it was not measured here and, where the
    calibration's budget cut the family, how to measure the rest; the call runs on plain PyTorch."""
    from dispatch.select import explain_call

    user, _ = dirs
    doc = document([entry([(1, "eager")], mode="inference", dropout=False)])
    doc["settings"] = {"families": {
        "bias_act_dropout float32 training dropout": {"spent_s": 9.0, "series_planned": 3, "series_left": 2},
        "bias_act_dropout float32 inference": {"spent_s": 5.0, "series_planned": 3, "series_left": 0},
    }}  # fmt: skip
    heuristics.save_table(doc, str(user / f"{CPU_SLUG}.json"))
    cut = explain_call(bad_call(64), None)
    assert cut.backend.name == "pytorch"
    assert "not measured here" in cut.rule and "--resume" in cut.rule and "default" not in cut.rule
    other = explain_call(bad_call(64, activation="relu", training=False, dropout=False), None)
    assert "not measured here" in other.rule and "--resume" not in other.rule
