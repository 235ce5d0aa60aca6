"""backends/triton/launch.py: the compiled-kernel cache key must be at least as fine as Triton's own
specialization (tensor dtype and 16-byte alignment; int width, == 1, % 16 == 0), so that a cached
kernel is never reused for arguments it was not compiled for. The CUDA launch itself runs in the
gpu tests of the kernels that use it."""

from __future__ import annotations

import pytest
import torch

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
