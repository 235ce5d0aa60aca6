"""Shared test setup: Triton's interpreter on machines without a GPU, a seed per test, the gpu marker;
the fixtures several test files share (a user directory for tables, synthetic calibration clocks, the
Triton matmul's launches)."""

import os
import tempfile
import time
import zlib
from types import SimpleNamespace

import pytest
import torch

HAS_GPU = torch.cuda.is_available()
if not HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton kernels
    # Inductor's C++ for CPU tensors, scalar: its vector-ISA probe (12 s of compiling test programs on a
    # cold cache) and vectorised codegen take 17% of the inductor tests' 164 s on a 2-core CPU. What
    # those tests check (which graph serves which call, masks, strides, bits against eager) does not
    # depend on the ISA; a GPU run keeps inductor's defaults.
    import torch._inductor.config

    torch._inductor.config.cpp.simdlen = 0

DEVICE = "cuda" if HAS_GPU else "cpu"

# Tables the user calibrated (~/.cache/fusedispatch/heuristics) must not change what tests see; the
# shipped dispatch/heuristics/tables/ still apply.
os.environ["DISPATCH_HEURISTICS_DIR"] = tempfile.mkdtemp(prefix="fusedispatch-heuristics-")


def pytest_collection_modifyitems(config, items):
    # the long tests first: pytest-xdist hands tests out in this order, and a 27 s test handed out last
    # is the whole run's tail
    items.sort(key=lambda item: "long" not in item.keywords)
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device with -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def seed(request):
    """A fresh, reported seed per test: fresh random data, reproducible from the test id."""
    value = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(value)
    return value


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture
def spec_masks():
    """Dropout by dispatch.contracts.rng's spec on every call (dispatch.spec_masks()): for tests that
    replay the spec's mask through the public ops, which otherwise may run plain PyTorch's dropout."""
    import dispatch

    dispatch.spec_masks(True)
    yield
    dispatch.spec_masks(False)


# ----------------------------------------------------------------------------- heuristics tables, calibration


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    """An empty user directory (where lookups look first and calibrate writes) and no shipped tables;
    caches cleared before and after."""
    from dispatch import heuristics, select

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


@pytest.fixture
def clocks(monkeypatch):
    """Eager twins 'flat' and 'slow' under synthetic clocks, us per call as functions of M: eager's GPU
    time grows 10x faster than flat's, so they cross at M = 111 on the GPU clock; host costs are
    constant. Plain PyTorch takes 1.2x eager's time on both clocks (beyond NOISE: it wins nothing) unless
    a test sets its own. The parity checks stay real (the twins compute what eager does)."""
    from dispatch.calibrate import measure, plan
    from harness import eager_twin, register

    register(monkeypatch, eager_twin("flat"), eager_twin("slow"))
    gpu = {"eager": lambda m: 10 + 0.1 * m, "flat": lambda m: 20 + 0.01 * m, "slow": lambda m: 100 + m}
    host = dict.fromkeys(gpu, lambda m: 5.0)
    gpu[plan.BASELINE] = lambda m: 1.2 * gpu["eager"](m)
    host[plan.BASELINE] = lambda m: 1.2 * host["eager"](m)
    delay = {}  # (name, training, dropout) -> seconds the first call at a feature size sleeps (a compile)
    compiled = set()

    def timer(name, case, inp):
        return measure.Timer(lambda: None, [], 1, name, case)

    def first(self, t):
        kind = (t.name, t.case.training, t.case.dropout)
        if (kind, t.case.features, t.case.activation) not in compiled:
            compiled.add((kind, t.case.features, t.case.activation))
            time.sleep(delay.get(kind, 0.0))
        return 0.0

    def sample(self, t, est_ms):
        return measure.Timed(gpu[t.name](t.case.m), host[t.name](t.case.m), "graph", False)

    monkeypatch.setattr(measure, "timer", timer)
    monkeypatch.setattr(measure.Clock, "first", first)
    monkeypatch.setattr(measure.Clock, "estimate_ms", lambda self, t: 0.0)
    monkeypatch.setattr(measure.Clock, "sample", sample)
    return gpu, host, delay


# ----------------------------------------------------------------------------- Triton


@pytest.fixture
def launches(monkeypatch):
    """The Triton matmul's launches during the test: (config, variant) that ran, output c, keywords."""
    from dispatch.backends.triton import matmul

    calls = []
    launch = matmul.launch

    def counted(a, b, c, **kwargs):
        calls.append(SimpleNamespace(plan=matmul.plan(a, b)[:2], out=c, kwargs=kwargs))
        return launch(a, b, c, **kwargs)

    monkeypatch.setattr(matmul, "launch", counted)
    return calls
