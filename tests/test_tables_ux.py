"""Tables that are not silently lost and output a newcomer can read: the nearest CPU table by thread
count, skipped files and broken settings named by ``python -m dispatch.info`` and explain(), CPU output
without GPU words, the table printer's choices; the heuristics package as an index of its modules."""

import os
import tempfile
import subprocess
import sys
import warnings

import pytest
import torch

from dispatch import calibrate, explain, heuristics, info, select
from dispatch import table as table_cli
from dispatch.calibrate import plan
from dispatch.heuristics import ranking
from dispatch.registry import Call, backends
from test_heuristics import CPU, CPU_SLUG, bad_call, dirs, document, entry  # noqa: F401  (dirs: a fixture)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = heuristics.cpu_model()
HERE = torch.get_num_threads()


def ours(caught):
    return [str(w.message) for w in caught if issubclass(w.category, heuristics.HeuristicsWarning)]


# ----------------------------------------------------------------------------- the package


def test_the_package_is_an_index_of_its_modules():
    """Every name the rest of the code uses is importable from dispatch.heuristics, and each is defined
    in one of its modules, none in the index; no module passes 400 lines."""
    used = ["lookup", "load_table", "save_table", "reload", "Table", "device_info", "ENV_DIR", "Choice",
            "HeuristicsWarning", "SCHEMA_VERSION", "running_versions", "describe", "slim", "user_dir",
            "slugify", "resolve", "all_tables", "max_measured_m", "SHIPPED_DIR", "CALIBRATE_HINT",
            "SchemaError", "Segment", "Entry", "dumps", "EntryKey", "EntryId"]  # fmt: skip
    for name in used:
        value = getattr(heuristics, name)
        if callable(value) and hasattr(value, "__module__"):
            assert value.__module__.startswith("dispatch.heuristics."), (name, value.__module__)
    folder = os.path.dirname(heuristics.__file__)
    for name in os.listdir(folder):
        if name.endswith(".py"):
            with open(os.path.join(folder, name)) as f:
                assert len(f.readlines()) <= 400, name


def test_the_table_printer_never_imports_the_calibrator():
    """The ranking rule lives with the tables it fills; the calibrator imports it from there."""
    code = "import sys, dispatch.table; print([m for m in sys.modules if m.startswith('dispatch.calibrate')])"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stderr
    for name in ("NOISE", "PREFERENCE", "PREFERENCE_INFERENCE", "BASELINE", "costs", "rank", "winner",
                 "bound", "preference", "estimated"):  # fmt: skip
        assert getattr(plan, name) is getattr(ranking, name), name


def test_one_entry_key_for_the_table_and_the_calibrator():
    """The key a call is looked up by is the key of the table entry the calibrator writes for it;
    dropout is part of it only for bias_act_dropout."""
    e = entry([(1, "eager")], op="fused_linear", features=(64, 32), dropout=True)
    table = heuristics.Table(document([e]), "t")
    call = Call("fused_linear", CPU, torch.float32, (8, 64, 32), "gelu", False, True)
    key = heuristics.EntryKey.of_call(call)
    assert list(table.index) == [key] and key.dropout is False and key.mode == "training"
    assert heuristics.EntryId.of_entry(e) == (key, (64, 32))
    assert table.choose(call).backend == "eager"


# ----------------------------------------------------------------------------- a CPU's thread count


def cpu_table(threads, backend, user, model=MODEL, with_field=True):
    slug = heuristics.cpu_slug(model, threads)
    doc = document([entry([(1, backend)])], slug=slug, name=model)
    if with_field:
        doc["device"]["threads"] = threads
    heuristics.save_table(doc, str(user / f"{slug}.json"))
    return slug


def test_a_cpu_without_its_thread_count_uses_the_nearest_with_one_warning(dirs):
    """This CPU has tables at 1 and 8 threads and none at its own thread count: lookups use the
    nearest thread count (in log scale) with one warning naming it, and describe() and explain() say
    which; another CPU model's table is never used."""
    user, _ = dirs
    near, far = (HERE * 2, HERE * 16) if HERE > 1 else (2, 16)
    near_slug = cpu_table(near, "nvfuser", user, with_field=False)  # the count from its slug
    cpu_table(far, "inductor", user)
    cpu_table(HERE, "triton", user, model="Some Other CPU")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        choices = [heuristics.lookup(bad_call(m)) for m in (1, 2, 3)]
        described = heuristics.describe(CPU)
    msgs = ours(caught)
    assert len(msgs) == 1, msgs
    assert near_slug in msgs[0] and f"at {HERE} thread" in msgs[0], msgs
    assert "python -m dispatch.calibrate" in msgs[0], msgs
    assert {c.backend for c in choices} == {"nvfuser"}
    assert f"calibrated at {near} threads, the nearest to this process's {HERE}" in choices[0].description
    assert described.startswith(f"heuristics table {near_slug}, calibrated at {near} threads"), described


def test_set_num_threads_1_uses_the_table_of_this_cpu_at_another_count(dirs):
    user, _ = dirs
    slug = cpu_table(2, "nvfuser", user)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        heuristics.reload()
        select.clear_cache()
        x, b = torch.randn(64, 4096), torch.randn(4096)
        with pytest.warns(heuristics.HeuristicsWarning, match=f"using {slug}"):
            rule = explain("fused_bias_act_dropout", x, b, "gelu", 0.1).rule
        assert f"heuristics table {slug}, calibrated at 2 threads" in rule, rule
    finally:
        torch.set_num_threads(before)


# ----------------------------------------------------------------------------- what info and explain name


def test_a_skipped_table_is_named_with_its_reason_by_info_and_explain(dirs, capsys):
    user, _ = dirs
    path = user / f"{CPU_SLUG}.json"
    path.write_text('{"schema_version": 7}')
    x, b = torch.randn(64, 4096), torch.randn(4096)
    with pytest.warns(heuristics.HeuristicsWarning, match="ignoring heuristics table"):
        rule = explain("fused_bias_act_dropout", x, b, "gelu", 0.1).rule
    why = "schema_version 7, this code reads 1 and 2"
    assert "no calibrated table" in rule and f"skipped {path}: {why}" in rule, rule
    info.main(["--device", "cpu"])
    printed = capsys.readouterr().out
    assert f"warning: skipped heuristics table {path}: {why}" in printed, printed


@pytest.mark.parametrize("kind", ["missing", "file"])
def test_info_flags_a_heuristics_dir_that_serves_no_table(tmp_path, monkeypatch, capsys, kind):
    path = tmp_path / "tables"
    if kind == "file":
        path.write_text("")
    monkeypatch.setenv(heuristics.ENV_DIR, str(path))
    heuristics.reload()
    try:
        info.main(["--device", "cpu"])
        printed = capsys.readouterr().out
        words = "is a file, not a directory" if kind == "file" else "does not exist"
        assert f"warning: DISPATCH_HEURISTICS_DIR={path} {words}" in printed, printed
        assert words in heuristics.describe(CPU)
        if kind == "file":  # refused before measuring anything
            refused = f"{path} is a file, not a directory .named by {heuristics.ENV_DIR}"
            with pytest.raises(SystemExit, match=refused):
                calibrate.main(["--quick"])
    finally:
        heuristics.reload()


def test_info_flags_an_unknown_dispatch_backend(monkeypatch, capsys):
    monkeypatch.setenv(select.ENV_VAR, "bogus")
    info.main(["--device", "cpu"])
    printed = capsys.readouterr().out
    line = next(x for x in printed.splitlines() if x.startswith("warning: DISPATCH_BACKEND"))
    assert "bogus is not a registered backend" in line and all(n in line for n in backends()), line
    monkeypatch.setenv(select.ENV_VAR, "eager")
    info.main(["--device", "cpu"])
    assert "warning:" not in capsys.readouterr().out


# ----------------------------------------------------------------------------- CPU output


def one_clock_document():
    """A CPU table as the calibrator writes one: both clocks the wall time; the winner by "GPU time"
    (which excludes compiling backends) differs from the winner."""
    e = entry([(1, "inductor")])
    wall = {"inductor": 50.0, "eager": 60.0}
    e["segments"][0].update(gpu_us=wall, host_us=dict(wall), gpu_backend="eager", clock="gpu")
    for p in e["points"]:
        p["host_us"] = dict(p["gpu_us"])
    doc = document([e])
    doc["device"]["threads"] = HERE
    doc["self_check"] = {"points": 4, "within_5pct": 1.0, "worst_regret": 0.0, "worst_vs_pytorch": 0.0}
    return doc


def test_a_cpu_table_speaks_of_wall_time_not_gpus(dirs, capsys):
    user, _ = dirs
    path = user / f"{CPU_SLUG}.json"
    heuristics.save_table(one_clock_document(), str(path))
    text = heuristics.lookup(bad_call(64)).description
    assert "the fastest by wall time" in text and "wall time 50 us" in text, text
    assert "GPU" not in text and "CUDA" not in text and "host" not in text, text
    assert table_cli.main(["--gpu", str(path)]) == 0
    printed = capsys.readouterr().out
    device = next(x for x in printed.splitlines() if x.startswith("device:"))
    assert device == f"device: test device ({CPU_SLUG}, cpu, timed with {HERE} thread{'s' * (HERE != 1)}, " \
                     "wall time (one clock))"  # fmt: skip
    for gpu_word in ("capability", "SMs", "GB/s", "GPU", "host-bound", "cuda None", "CUDA graph"):
        assert gpu_word not in printed, (gpu_word, printed)
    info.main(["--device", "cpu"])
    printed = capsys.readouterr().out
    assert f"device: cpu: {MODEL}, {HERE} thread" in printed and "SMs" not in printed, printed


def test_the_table_printer_lists_the_valid_activations(capsys):
    with pytest.raises(SystemExit) as exited:
        table_cli.main(["--activation", "foo"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'foo'" in err and "gelu_tanh" in err and "squared_relu" in err, err


@pytest.mark.parametrize("activation", ["swiglu", "geglu_tanh", "relu"])
def test_the_table_printer_takes_every_activation_an_op_has(capsys, activation):
    """Gates are activations of fused_mlp: the filter accepts every name an op declares."""
    from table_docs import valid_document

    path = os.path.join(tempfile.mkdtemp(), "t.json")
    heuristics.save_table(valid_document(), path)
    assert table_cli.main(["--gpu", path, "--activation", activation]) in (0, None)
