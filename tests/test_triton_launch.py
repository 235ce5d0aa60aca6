"""dispatch/backends/triton/launch.py: the compiled-kernel cache key must be at least as fine as Triton's own
specialization (tensor dtype and 16-byte alignment; int width, == 1, % 16 == 0), so that a cached
kernel is never reused for arguments it was not compiled for; constexprs are passed by name and must
be exactly the kernel's; the private fast path is gated on the Triton versions it was tested with.
The CUDA launch itself runs in the gpu tests of the kernels that use it."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from dispatch.backends.triton import launch
from dispatch.backends.triton.launch import Launcher

launcher = Launcher(kernel=None, tensors=2)


def _key(*args, constexprs=("gelu", 8), warps=4):
    return launcher._key(0, warps, constexprs, args)


def test_same_specialization_same_key():
    a, b = torch.empty(64), torch.empty(64)
    assert _key(a, b, 33, 4096, 0.5) == _key(b, a, 17, 8192, 0.25)  # odd ints, multiples of 16, floats


@pytest.mark.parametrize(
    "change",
    [
        lambda a, b: (a.to(torch.float16), b, 33, 4096, 0.5),  # dtype
        lambda a, b: (a[1:], b, 33, 4096, 0.5),  # 4-byte offset: not 16-byte aligned
        lambda a, b: (a, b, 1, 4096, 0.5),  # == 1
        lambda a, b: (a, b, 32, 4096, 0.5),  # % 16 == 0
        lambda a, b: (a, b, 33, 2**31, 0.5),  # 64-bit
        lambda a, b: (a, b, 33, -(2**31) - 16, 0.5),  # 64-bit, negative
    ],
    ids=["dtype", "alignment", "one", "divisible", "int64", "int64-negative"],
)
def test_each_specialization_changes_the_key(change):
    a, b = torch.empty(64), torch.empty(64)
    assert _key(a, b, 33, 4096, 0.5) != _key(*change(a, b))


def test_constexprs_and_warps_are_in_the_key():
    a, b = torch.empty(64), torch.empty(64)
    assert _key(a, b, 3) != _key(a, b, 3, constexprs=("relu", 8))
    assert _key(a, b, 3) != _key(a, b, 3, warps=8)


def test_descriptors_are_keyed_by_dtype_and_block_shape_only():
    """Triton specializes a host TensorDescriptor on its dtype and block shape ("tensordesc<bf16[32,
    16]>"); its base, shape and strides are runtime arguments, encoded at every launch."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    tma = Launcher(kernel=None, tensors=1, descriptors=1)

    def key(t, block, stages=3):
        d = TensorDescriptor(t, list(t.shape), list(t.stride()), block)
        return tma._key(0, 8, (128,), (d, torch.empty(4), 7), stages)

    a = torch.randn(64, 96, dtype=torch.bfloat16)
    other = torch.randn(8, 16, dtype=torch.bfloat16)
    assert key(a, [32, 16]) == key(a[:48, :80], [32, 16]) == key(other, [32, 16])
    assert key(a, [32, 16]) != key(a, [64, 16])
    assert key(a, [32, 16]) != key(a.to(torch.float16), [32, 16])
    assert key(a, [32, 16]) != key(a, [32, 16], stages=4)


@triton.jit
def _affine_kernel(
    X,  # (n,) input
    Y,  # (n,) output
    n,  # elements
    scale,  # float multiplier
    BLOCK: tl.constexpr,
    SHIFT: tl.constexpr,  # added after scaling
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(Y + offs, tl.load(X + offs, mask=mask) * scale + SHIFT, mask=mask)


def test_constexprs_by_name_in_any_order():
    """Constexprs are given by name, in any order; the launcher passes them in parameter order."""
    x = torch.randn(37)
    y = torch.empty(37)
    affine = Launcher(_affine_kernel, tensors=2)
    assert affine.constexprs == ("BLOCK", "SHIFT")
    affine((3,), (x, y, 37, 2.0), dict(SHIFT=1.0, BLOCK=16), num_warps=1)
    torch.testing.assert_close(y, x * 2.0 + 1.0)


@pytest.mark.parametrize(
    "constexprs, message",
    [
        (dict(BLOCK=16), "missing ['SHIFT']"),
        (dict(BLOCK=16, SHIFT=1.0, EXTRA=3), "unexpected ['EXTRA']"),
        (dict(BLOCK=16, SHIFTS=1.0), "missing ['SHIFT'], unexpected ['SHIFTS']"),
    ],
    ids=["missing", "extra", "misspelt"],
)
def test_constexpr_names_must_be_the_kernels(constexprs, message):
    affine = Launcher(_affine_kernel, tensors=2)
    with pytest.raises(TypeError, match="_affine_kernel takes the constexprs BLOCK, SHIFT") as error:
        affine((1,), (torch.empty(4), torch.empty(4), 4, 1.0), constexprs, num_warps=1)
    assert message in str(error.value)


def test_constexprs_must_be_a_dict():
    affine = Launcher(_affine_kernel, tensors=2)
    with pytest.raises(TypeError, match="constexprs must be a dict of name -> value, got tuple"):
        affine((1,), (torch.empty(4), torch.empty(4), 4, 1.0), (16, 1.0), num_warps=1)


@pytest.mark.parametrize(
    "version, parsed", [("3.6.0", (3, 6)), ("3.6.1+git1a2b3c", (3, 6)), ("3.10.0", (3, 10)), ("dev", None)]
)
def test_major_minor(version, parsed):
    assert launch.major_minor(version) == parsed


class _CudaLooking:
    """Stands in for a CUDA tensor: only the gate's ``is_cuda`` is read on the fallback path."""

    is_cuda = True


def test_untested_triton_launches_through_kernel_getitem(monkeypatch):
    """On a Triton version the fast path was not tested with, a CUDA launch goes through
    ``kernel[grid](...)`` (the private ``CompiledKernel.run`` is never reached), constexprs in the
    kernel's parameter order; a tested version takes the fast path; the environment overrides both."""
    monkeypatch.delenv(launch.FAST_LAUNCH_ENV, raising=False)
    monkeypatch.setattr(launch, "TRITON_VERSION", (3, 6))
    assert Launcher(_affine_kernel, tensors=2).fast
    monkeypatch.setattr(launch, "TRITON_VERSION", (3, 99))
    affine = Launcher(_affine_kernel, tensors=2)
    assert not affine.fast
    launched = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **options: launched.append((grid, args, options))

    affine.kernel = Kernel()
    x, y = _CudaLooking(), _CudaLooking()
    affine((2,), (x, y, 37, 2.0), dict(SHIFT=1.0, BLOCK=16), num_warps=4)
    assert launched == [((2,), (x, y, 37, 2.0, 16, 1.0), {"num_warps": 4})]
    assert not affine._compiled
    monkeypatch.setenv(launch.FAST_LAUNCH_ENV, "1")
    assert Launcher(_affine_kernel, tensors=2).fast
    monkeypatch.setenv(launch.FAST_LAUNCH_ENV, "0")
    monkeypatch.setattr(launch, "TRITON_VERSION", (3, 6))
    assert not Launcher(_affine_kernel, tensors=2).fast
