"""Shared test setup: Triton's interpreter on machines without a GPU, a seed per test, the gpu marker."""

import os
import tempfile
import zlib

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
# shipped heuristics/tables/ still apply.
os.environ["DISPATCH_HEURISTICS_DIR"] = tempfile.mkdtemp(prefix="fusedispatch-heuristics-")


def pytest_collection_modifyitems(config, items):
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
