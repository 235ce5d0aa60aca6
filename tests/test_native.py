"""dispatch.native: the fast path's tensor reads in C++ give exactly what their Python twins give, for
the common valid calls (a tuple) and for everything else (None: the full checks then decide)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from dispatch import api, fused_linear, native

BUILD_WAIT_S = 600  # a first build compiles against torch's headers: ~30 s on a 2-core machine


@pytest.fixture(scope="module")
def module():
    built = native.wait(BUILD_WAIT_S)
    compiler = shutil.which(os.environ.get("CXX", "c++"))
    if compiler is None or not native.enabled():
        # the twins stay: the ops must then run on them, and the status must say why
        assert built is None and native.status().startswith("Python"), native.status()
        assert api._linear_signature is api._linear_signature_py
        return None
    assert built is not None, native.status()
    assert api._linear_signature is built.linear_signature, "the ops do not read through the module"
    return built


def _devices() -> list[str]:
    return ["cpu", "meta"] + (["cuda"] if torch.cuda.is_available() else [])


def _cases():
    """(x, weight, bias) triples: valid ones of every floating dtype, rank, grad state, device and bias
    layout, and invalid ones of each kind (each must read None)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for device in _devices():
        for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            for x_shape in ((5,), (3, 5), (2, 3, 5), (2, 1, 3, 5), (0, 5)):
                x = torch.randn(x_shape, generator=g).to(device=device, dtype=dtype)
                w = torch.randn(4, 5, generator=g).to(device=device, dtype=dtype)
                b = torch.randn(4, generator=g).to(device=device, dtype=dtype)
                out += [(x, w, b), (x, w, None), (x.detach().requires_grad_(), w, b)]
            x = torch.randn(3, 5, generator=g).to(device=device, dtype=dtype)
            w = torch.nn.Parameter(torch.randn(4, 5, generator=g).to(device=device, dtype=dtype))
            b = torch.nn.Parameter(torch.randn(8, generator=g).to(device=device, dtype=dtype)[::2])
            out += [(x, w, b), (x, w.detach(), b.detach()), (x.t().contiguous().t(), w, None)]
    x, w, b = torch.randn(3, 5), torch.randn(4, 5), torch.randn(4)
    out += [
        (x, w, b.double()), (x, w.half(), b), (x.double(), w, b),  # dtypes that differ
        (x, w, torch.randn(5)), (x, torch.randn(4, 6), b), (x, torch.randn(4, 5, 1), b),  # shapes
        (torch.randn(()), w, b), (x.int(), w.int(), b.int()),  # 0-d, not floating
        (x.to_sparse(), w, b), (x, w, b.to("meta")), (x.to("meta"), w, b),  # layout, devices
        (x.as_subclass(_Sub), w, b), (x, w.as_subclass(_Sub), b), (x, w, b.as_subclass(_Sub)),  # types
        ("x", w, b), (x, None, b), (x, w, 1.0),
    ]  # fmt: skip
    if torch.cuda.is_available():
        out += [(x.cuda(), w, b), (x.cuda(), w.cuda(), b), (x, w, b.cuda())]
    return out


class _Sub(torch.Tensor):
    pass


@pytest.mark.parametrize("grad_mode", [True, False])
def test_signatures_match_their_python_twins(module, grad_mode):
    if module is None:
        return  # the fixture asserted the fallback; the twins are what runs
    answered = 0
    with torch.set_grad_enabled(grad_mode):
        for x, w, b in _cases():
            if isinstance(x, torch.Tensor) and x.is_sparse:
                continue  # the twins' reads pass a sparse x on: the next test
            expected = api._linear_signature_py(x, w, b)
            answered += expected is not None
            assert module.linear_signature(x, w, b) == expected, (x.shape, x.dtype, x.device, w, b)
            if isinstance(x, torch.Tensor) and x.dim() > 0:  # bias_act: x's own width, and others
                n = x.shape[-1]
                own = torch.randn(2 * n, dtype=x.dtype if x.is_floating_point() else None)[::2]
                for bias in (None, b, own, own.contiguous().to(x.device), own.to(x.device)):
                    want = api._bias_act_signature_py(x, bias)
                    answered += want is not None
                    assert module.bias_act_signature(x, bias) == want, (x.shape, x.dtype, bias)
    assert answered > 200  # the valid calls were many, and read as such


def test_sparse_and_nested_inputs_take_the_full_path(module):
    """The C++ reads refuse layouts the Python twins would pass on (their attribute reads work for a
    sparse x): the full path then runs, with the same result as before."""
    if module is None:
        return
    x, w = torch.randn(3, 5), torch.randn(4, 5)
    assert module.linear_signature(x.to_sparse(), w, None) is None
    assert module.bias_act_signature(x.to_sparse(), None) is None


def test_a_torch_function_mode_takes_the_full_path(module):
    """Under a TorchFunctionMode the C++ reads step aside, so the mode sees the attribute reads as it
    does in the Python twins and the full path."""
    if module is None:
        return

    class Seen(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    x, w = torch.randn(3, 5), torch.randn(4, 5)
    assert module.linear_signature(x, w, None) is not None
    with Seen():
        assert module.linear_signature(x, w, None) is None
        assert module.bias_act_signature(x, None) is None
        y = fused_linear(x, w, None, "relu")
    torch.testing.assert_close(y, torch.relu(x @ w.t()))


def test_off_switch_and_status():
    """DISPATCH_NATIVE=0: the Python reads, and dispatch.info says so."""
    env = dict(os.environ, DISPATCH_NATIVE="0")
    out = subprocess.run(
        [sys.executable, "-c", "from dispatch import native, api, fused_linear; import torch; "
         "print(native.status()); print(api._linear_signature is api._linear_signature_py); "
         "print(fused_linear(torch.ones(2, 3), torch.ones(4, 3)).sum().item())"],
        capture_output=True, text=True, env=env, check=True, timeout=300,
    ).stdout.split("\n")  # fmt: skip
    assert out[:3] == ["Python (DISPATCH_NATIVE=0)", "True", "24.0"], out
