"""Calibration runs over time, under synthetic clocks: the budget shared by the families, whole
classes when it stops a run, --resume and --refresh, the table already at --out (kept where not
measured again, never overwritten when the run cannot extend it), and the summary a run ends with."""

import json

import pytest

from dispatch import heuristics
from dispatch import calibrate, ops
from dispatch import table as table_cli
from dispatch.calibrate import gate
from dispatch.calibrate import run as runner
from calibration import CPU, args, segments
from harness import eager_twin, register


def test_budget_is_shared_by_the_families_and_resume_continues(user_dir, clocks, capsys):
    """flat's first call at each size sleeps 0.7 s in the training families (a compile), the first of
    them first in line: they cannot measure every series in a 7 s budget, but every family is measured
    (the one that has spent least per planned series goes next), the fast ones whole, and a --resume
    measures what was left, keeping the rest as it was."""
    _, _, delay = clocks
    delay[("flat", True, True)] = delay[("flat", True, False)] = 0.7
    out = user_dir / "t.json"
    many = dict(modes=("inference", "training"), acts=("gelu", "relu"), features=("32", "40", "48"))
    assert calibrate.main(args(out, "--budget", "7", **many)) == 0
    data = heuristics.load_table(str(out)).data
    fams = data["settings"]["families"]
    assert len(fams) == 4 and data["settings"]["stopped_by_budget"]
    measured = {(e["mode"], e["dropout"]) for e in data["entries"]}
    assert measured == {("inference", False), ("inference", True), ("training", False), ("training", True)}
    for label, f in fams.items():
        assert ("training" in label) == (f["series_left"] > 0), (label, f)
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("not measured")]
    assert len(said) == 1 and "bias_act_dropout float32 training" in said[0] and "--resume" in said[0], said
    first = {heuristics.EntryId.of_entry(e): e for e in data["entries"]}
    assert calibrate.main(args(out, "--resume", "--budget", "600", **many)) == 0
    data = heuristics.load_table(str(out)).data
    assert not data["settings"]["stopped_by_budget"]
    assert all(f["series_left"] == 0 for f in data["settings"]["families"].values())
    assert [(r["run"], r["parts"]) for r in data["settings"]["runs"]] == [("quick", 2)]
    resumed = {heuristics.EntryId.of_entry(e): e for e in data["entries"]}
    assert len(resumed) == 4 * 2 * 3 and all(resumed[k] == e for k, e in first.items())


def test_a_run_the_budget_stops_has_whole_classes(user_dir, clocks):
    """A series' members are checked right after it, also past the deadline: each first call sleeps
    0.4 s (a compile), so a 3 s budget stops the run partway through its sizes, and every measured
    representative has every member of its class beside it, with its winners checked ('flat' compiles
    nothing, so its checks run past the deadline too)."""
    _, _, delay = clocks
    delay[("flat", False, False)] = delay[("eager", False, False)] = 0.4
    out = user_dir / "t.json"
    acts = ("gelu", "gelu_tanh", "silu", "relu", "identity")
    assert calibrate.main(args(out, "--budget", "3", acts=acts, features=("32", "40", "48", "56"))) == 0
    data = heuristics.load_table(str(out)).data
    assert data["settings"]["stopped_by_budget"]
    have = {(e["activation"], e["features"][0], e["dropout"]): e for e in data["entries"]}
    reps = {(a, n, d) for a, n, d in have if a in ("gelu", "relu")}
    assert {(a, n) for a, n, d in reps if not d} and len(reps) < 16  # stopped partway
    for rep, n, d in reps:
        cls = next(c for c in ops.get("bias_act_dropout").grid.classes if rep in c)
        assert {(a, n, d) for a in cls if a in acts} <= set(have), (rep, n, d, sorted(have))
        if "flat" in {s["backend"] for s in have[(rep, n, d)]["segments"]}:
            for a in (a for a in cls[1:] if a in acts):
                assert "flat" in {s["backend"] for s in have[(a, n, d)]["segments"]}, (a, n, d)


def test_a_check_skipped_past_the_deadline_is_made_by_resume(user_dir, clocks, monkeypatch):
    """'fast' compiles per kind of call and wins everywhere: past the deadline a member's check by it is
    skipped (it would compile), so the member runs eager there and the run says it stopped; --resume
    checks it and the member gets 'fast' as its representative did."""
    gpu, host, _ = clocks
    register(monkeypatch, eager_twin("fast", compiles=True))
    gpu["fast"], host["fast"] = (lambda m: 1.0), (lambda m: 1.0)
    out = user_dir / "t.json"
    monkeypatch.setattr(runner, "END_S", 0.0)
    # the deadline passes once the first series has its entry
    monkeypatch.setattr(runner.Run, "left", lambda self: -1.0 if self.entries else 1.0)
    many = dict(acts=("gelu", "gelu_tanh"), backends=("fast",))
    assert calibrate.main(args(out, "--budget", "600", **many)) == 0
    data = heuristics.load_table(str(out)).data
    member = next(e for e in data["entries"] if e["activation"] == "gelu_tanh" and not e["dropout"])
    assert [s["backend"] for s in member["segments"]] == ["eager"] and data["settings"]["stopped_by_budget"]
    assert gate.UNCHECKED in {why for p in member["points"] for why in p["rejected"].values()}
    monkeypatch.undo()
    register(monkeypatch, eager_twin("fast", compiles=True))
    assert calibrate.main(args(out, "--resume", "--budget", "600", **many)) == 0
    data = heuristics.load_table(str(out)).data
    member = next(e for e in data["entries"] if e["activation"] == "gelu_tanh" and not e["dropout"])
    assert {s["backend"] for s in member["segments"]} == {"fast"}
    assert not data["settings"]["stopped_by_budget"]


def test_agree_without_refit_is_refused():
    with pytest.raises(SystemExit, match="--refit"):
        calibrate.main(["--agree", "x.json"])


def test_refresh_measures_the_selected_families_again_and_keeps_the_rest(user_dir, clocks):
    gpu, _, _ = clocks
    out = user_dir / "t.json"
    both = dict(modes=("inference", "training"))
    assert calibrate.main(args(out, **both)) == 0
    first = {e["mode"]: e for e in heuristics.load_table(str(out)).data["entries"] if not e["dropout"]}
    gpu["flat"] = lambda m: 1e4  # flat now loses everywhere
    assert calibrate.main(args(out, "--refresh", modes=("training",))) == 0
    data = heuristics.load_table(str(out)).data
    again = {e["mode"]: e for e in data["entries"] if not e["dropout"]}
    assert again["inference"] == first["inference"]
    assert [b for _, b in segments(again["training"])] == ["eager"] and segments(first["training"])[-1][
        1
    ] == "flat"
    assert [r["run"] for r in data["settings"]["runs"]] == ["quick", "refresh"]
    st = data["settings"]
    assert st["series_measured"] == st["series_planned"] == 2  # training's two, not inference's kept ones
    assert "refreshed since: bias_act_dropout float32 training" in "\n".join(
        table_cli.provenance(heuristics.load_table(str(out)))
    )


def test_a_slim_table_cannot_be_resumed(user_dir, clocks):
    out, slim = user_dir / "raw.json", user_dir / "slim.json"
    assert calibrate.main(args(out, "--slim-out", str(slim))) == 0
    thin = json.loads(slim.read_text())
    assert thin["raw_points"]["file"] == str(out) and all("points" not in e for e in thin["entries"])
    assert all(e["segments"][0]["gpu_us"] for e in thin["entries"])  # both clocks stay per segment
    with pytest.raises(SystemExit, match="keeps no raw measured points"):
        calibrate.main(args(slim, "--resume"))


# ----------------------------------------------------------------------------- the table already at --out


def test_a_run_over_an_existing_table_keeps_what_it_does_not_measure_again(user_dir, clocks, capsys):
    """A plain run whose --out holds this device's table measures its own selection again and keeps
    every other entry, saying how many; the table's history names the run."""
    out = user_dir / "t.json"
    assert calibrate.main(args(out, modes=("inference", "training"))) == 0
    first = {heuristics.EntryId.of_entry(e): e for e in heuristics.load_table(str(out)).data["entries"]}
    capsys.readouterr()
    assert calibrate.main(args(out, modes=("training",))) == 0
    printed = capsys.readouterr().out
    data = heuristics.load_table(str(out)).data
    now = {heuristics.EntryId.of_entry(e): e for e in data["entries"]}
    assert now.keys() == first.keys() and len(now) == 4
    inference = [k for k in first if k.key.mode == "inference"]
    assert len(inference) == 2 and all(now[k] == first[k] for k in inference)
    assert "kept 2 of the 4 entries of the table already there; the other 2 measured again" in printed
    assert [(r["run"], r.get("families")) for r in data["settings"]["runs"]] == [
        ("quick", None), ("quick", ["bias_act_dropout float32 training"])]  # fmt: skip
    assert "measured again since by quick: bias_act_dropout float32 training" in "\n".join(
        table_cli.provenance(heuristics.load_table(str(out)))
    )


def schema_1_table(info):
    seg = {"m_from": 1, "backend": "eager", "runner_up": None, "margin": None}
    entry = {"op": "bias_act_dropout", "dtype": "float32", "activation": "gelu", "mode": "inference",
             "dropout": False, "features": [32], "segments": [seg],
             "points": [{"m": 1, "ms": {"eager": 1.0}}]}  # fmt: skip
    return {"schema_version": 1, "device": info, "entries": [entry]}


@pytest.mark.parametrize("kind", ["other device", "schema 1", "not a table"])
def test_a_file_the_run_cannot_extend_is_never_overwritten(user_dir, clocks, kind):
    """Another device's table, a schema 1 table or a file that is no table at --out: the run stops
    before measuring, names the file and --out, and leaves the file as it was."""
    out = user_dir / "t.json"
    info = heuristics.device_info(CPU)
    if kind == "not a table":
        out.write_text("{ not json")
    elif kind == "schema 1":
        out.write_text(json.dumps(schema_1_table(info)))
    else:
        assert calibrate.main(args(out)) == 0
        doc = json.loads(out.read_text())
        doc["device"] = {"type": "cuda", "name": "NVIDIA H200", "slug": "nvidia-h200", "capability": [9, 0]}
        out.write_text(json.dumps(doc))
    before = out.read_text()
    why = {"other device": "is the table of NVIDIA H200", "schema 1": "is a schema 1 table",
           "not a table": "is not a heuristics table"}[kind]  # fmt: skip
    with pytest.raises(SystemExit, match=f"{why}.*not overwriting it: give another --out"):
        calibrate.main(args(out))
    assert out.read_text() == before


def test_a_table_of_other_versions_is_replaced_with_a_word(user_dir, clocks, capsys):
    out = user_dir / "t.json"
    assert calibrate.main(args(out, modes=("inference", "training"))) == 0
    doc = json.loads(out.read_text())
    doc["versions"]["torch"] = "0.1"
    out.write_text(json.dumps(doc))
    capsys.readouterr()
    assert calibrate.main(args(out, modes=("training",))) == 0
    assert "--out: " + str(out) + " was calibrated with torch 0.1" in capsys.readouterr().err
    assert {e["mode"] for e in heuristics.load_table(str(out)).data["entries"]} == {"training"}


def test_calibrate_ends_with_a_summary_and_the_table_prints_once(user_dir, clocks, capsys):
    """The README's ``python -m dispatch.calibrate --quick && python -m dispatch.table``: calibrate
    prints a summary with each self-check target's verdict and where the choice tables are; the
    tables print once, by dispatch.table (or by calibrate with --tables)."""
    out = user_dir / f"{heuristics.device_info(CPU)['slug']}.json"  # where lookups look first
    assert calibrate.main(args(out)) == 0
    printed = capsys.readouterr().out
    assert "cell:" not in printed and "activation gelu" not in printed, printed
    assert printed.rstrip().endswith("the choice tables: python -m dispatch.table"), printed
    assert "within 5% of the fastest: 100% (target >= 95%) ok" in printed, printed
    assert table_cli.main([]) == 0
    assert capsys.readouterr().out.count("bias_act_dropout  float32  inference") == 2  # dropout and not
    other = user_dir / "elsewhere.json"
    assert calibrate.main(args(other, "--tables")) == 0
    printed = capsys.readouterr().out
    assert "cell:" in printed and f"the choice tables: python -m dispatch.table --gpu {other}" in printed
