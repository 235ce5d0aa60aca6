"""The patch tests' helpers: the state_dict round trip that every form ``patch`` rewrites must pass
(the same keys in the same order, one name per parameter, strict loads both ways, the same function),
the options it runs under, and Hugging Face models' output as one tensor."""

from __future__ import annotations

import copy

import torch
from torch import nn

from dispatch import patch
from dispatch.contracts.tolerances import ATOL, RTOL

NO_TRANSFORMERS = "transformers is not installed (pip install transformers): Hugging Face models not tested"

OPTIONS = {
    "default": {},
    "bias_in_dropout": {"bias_in_linear": False},
    "no_linear_dropout": {"linear_dropout": False},
}


def assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within the dtype's tolerance, relative to the output's scale (dispatch/contracts/tolerances.py)."""
    scale = float(want.detach().abs().max())
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL[want.dtype] + RTOL[want.dtype] * scale)


def randomize(model: nn.Module) -> nn.Module:
    """Fresh random values in every parameter (biases too, which some modules start at zero), so a
    load that skipped an entry would show."""
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    return model


def assert_state_dicts_equal(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for key in want:
        assert got[key].shape == want[key].shape, key
        assert torch.equal(got[key], want[key]), key


def assert_one_name_per_parameter(model: nn.Module, names: dict[str, nn.Parameter]) -> None:
    """``model``'s parameters are ``names`` (the original's), by the same names in named_parameters() and
    in the state_dict."""
    params = dict(model.named_parameters())
    assert list(params) == list(names) and all(params[n] is p for n, p in names.items())
    saved = model.state_dict(keep_vars=True)
    assert {k: v for k, v in saved.items() if isinstance(v, nn.Parameter)} == params


def check_round_trip(build, options: dict, x_fn, replaced: int) -> None:
    """patch(build()) keeps the keys and the parameters' names; original -> patched and patched ->
    original load strictly, with identical tensors and the same eval-mode outputs."""
    original = randomize(build()).eval()
    want = original.state_dict()

    patched = copy.deepcopy(original)
    names = dict(patched.named_parameters())
    report = patch(patched, **options)
    assert len(report) == replaced, str(report)
    assert_state_dicts_equal(patched.state_dict(), want)  # its own parameters, saved under the old keys
    assert_one_name_per_parameter(patched, names)

    # the original's checkpoint into a separately built, patched model
    target = randomize(build()).eval()
    patch(target, **options)
    assert any(not torch.equal(v, want[k]) for k, v in target.state_dict().items())
    target.load_state_dict(want, strict=True)
    assert_state_dicts_equal(target.state_dict(), want)
    x = x_fn()
    with torch.no_grad():
        assert_same(target(x), original(x))

    # and the patched model's checkpoint into an unpatched one
    back = randomize(build()).eval()
    back.load_state_dict(target.state_dict(), strict=True)
    assert_state_dicts_equal(back.state_dict(), want)
    with torch.no_grad():
        assert_same(back(x), original(x))


class LastHidden(nn.Module):
    """A Hugging Face model's last hidden state as one tensor, for checks that compare one output."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x).last_hidden_state
