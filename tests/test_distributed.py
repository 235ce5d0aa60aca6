"""torch.distributed with the public ops, on the CPU with gloo (2 processes): every rank decides alike,
DistributedDataParallel trains a fused MLP as one process does with the same global batch, dropout masks
differ between ranks and repeat under ``torch.manual_seed``, and FSDP2 (``fully_shard``) trains it and a
patched Hugging Face GPT-2 block as one process does.

Each test starts its ranks with ``torch.multiprocessing.spawn``; a rank's failure fails the test with
that rank's traceback. One spawn runs every check (a fresh interpreter imports torch in ~3 s a rank).
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dispatch import explain
from dispatch.nn import FusedBiasActDropout, FusedLinear

WORLD = 2
STEPS = 4
BATCH, IN, HIDDEN, OUT = 8, 12, 24, 6  # global batch 8: 4 rows a rank

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is not available"
)


def _mlp(p: float) -> torch.nn.Module:
    torch.manual_seed(0)  # the same initial weights in every process
    return torch.nn.Sequential(
        FusedLinear(IN, HIDDEN, activation="identity"),
        FusedBiasActDropout(HIDDEN, "gelu", p=p),
        FusedLinear(HIDDEN, OUT, activation="silu"),
    ).double()


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    """One global batch fitted for STEPS steps (so the loss must fall), as (STEPS, BATCH, .) tensors."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, IN, generator=gen, dtype=torch.float64)
    y = torch.randn(BATCH, OUT, generator=gen, dtype=torch.float64)
    return x.expand(STEPS, BATCH, IN), y.expand(STEPS, BATCH, OUT)


def _train(model: torch.nn.Module, xs: torch.Tensor, ys: torch.Tensor) -> list[float]:
    """Mean-squared-error SGD steps; the loss of each step (this process's rows)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x, y in zip(xs, ys):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _gpt2_block() -> torch.nn.Module:
    """A small Hugging Face GPT-2 block (dropout 0), patched: its MLP on our fused modules."""
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    from dispatch import patch

    torch.manual_seed(0)
    config = GPT2Config(n_embd=16, n_head=2, resid_pdrop=0.0, attn_pdrop=0.0, embd_pdrop=0.0)
    config._attn_implementation = "eager"
    block = GPT2Block(config).double()
    assert patch(block).replaced, "patch found no GPT-2 MLP"
    return block


class _Hidden(torch.nn.Module):
    """The block's hidden states alone (transformers returns a tuple in some versions)."""

    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.block(x)
        return out[0] if isinstance(out, tuple) else out


def _block_data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(BATCH, 5, 16, generator=gen, dtype=torch.float64)
    y = torch.randn(BATCH, 5, 16, generator=gen, dtype=torch.float64)
    return x.expand(STEPS, *x.shape), y.expand(STEPS, *y.shape)


def _decision_grid() -> list[str]:
    """explain() over a grid of calls: ops, shapes, dtypes, activations, grad and dropout."""
    out = []
    for dtype in (torch.float32, torch.float64):
        for m in (1, 64, 4096):
            for act in ("gelu", "relu", "identity"):
                for grad in (False, True):
                    x = torch.empty(m, 768, dtype=dtype).requires_grad_(grad)
                    b = torch.empty(768, dtype=dtype)
                    w = torch.empty(3072, 768, dtype=dtype)
                    out.append(str(explain("fused_bias_act_dropout", x, b, act, 0.1)))
                    out.append(str(explain("fused_linear", x, w, None, act)))
    return out


def _worker(rank: int, init: str, result_dir: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    try:
        torch.set_num_threads(1)
        results: dict = {}
        # 1. every rank decides alike
        grids = [None] * WORLD
        dist.all_gather_object(grids, _decision_grid())
        results["decisions_alike"] = all(g == grids[0] for g in grids)
        results["decisions"] = len(grids[0])

        # 2. DDP at p = 0: each rank its half of the global batch, the loss averaged over ranks
        xs, ys = _data()
        rows = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
        ddp = torch.nn.parallel.DistributedDataParallel(_mlp(0.0))
        local = torch.tensor(_train(ddp, xs[:, rows], ys[:, rows]), dtype=torch.float64)
        dist.all_reduce(local)
        results["ddp_losses"] = (local / WORLD).tolist()
        results["ddp_weights"] = [p.detach().clone() for p in ddp.module.parameters()]

        # 3. dropout: masks differ between ranks (their own seeds) and repeat under manual_seed
        layer = FusedBiasActDropout(HIDDEN, "identity", p=0.5).double()
        ones = torch.ones(64, HIDDEN, dtype=torch.float64)
        torch.manual_seed(100 + rank)
        first = layer(ones) != 0
        torch.manual_seed(100 + rank)
        again = layer(ones) != 0
        masks = [None] * WORLD
        dist.all_gather_object(masks, first)
        results["mask_repeats"] = bool(torch.equal(first, again))
        results["masks_differ"] = not torch.equal(masks[0], masks[1])

        # 4. FSDP2 at p = 0: the same losses as DDP's (full-batch gradient, parameters sharded)
        from torch.distributed.fsdp import fully_shard

        model = _mlp(0.0)
        for layer in model:
            if any(True for _ in layer.parameters()):
                fully_shard(layer)
        fully_shard(model)
        local = torch.tensor(_train(model, xs[:, rows], ys[:, rows]), dtype=torch.float64)
        dist.all_reduce(local)
        results["fsdp_losses"] = (local / WORLD).tolist()

        # 5. FSDP2 over a patched GPT-2 block
        block = _Hidden(_gpt2_block())
        fully_shard(block.block.mlp)
        fully_shard(block)
        bx, by = _block_data()
        local = torch.tensor(_train(block, bx[:, rows], by[:, rows]), dtype=torch.float64)
        dist.all_reduce(local)
        results["gpt2_fsdp_losses"] = (local / WORLD).tolist()
        torch.save(results, os.path.join(result_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks():
    with tempfile.TemporaryDirectory() as tmp:
        init = "file://" + os.path.join(tmp, "rendezvous")
        mp.spawn(_worker, args=(init, tmp), nprocs=WORLD, join=True)
        yield [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(WORLD)]


def _single_process() -> tuple[list[float], list[torch.Tensor]]:
    model = _mlp(0.0)
    xs, ys = _data()
    return _train(model, xs, ys), [p.detach() for p in model.parameters()]


def test_every_rank_decides_alike(ranks):
    assert all(r["decisions_alike"] for r in ranks) and ranks[0]["decisions"] == 72


def test_ddp_trains_like_one_process_with_the_global_batch(ranks):
    losses, weights = _single_process()
    for r in ranks:
        torch.testing.assert_close(torch.tensor(r["ddp_losses"]), torch.tensor(losses), rtol=1e-10, atol=1e-12)
        for got, want in zip(r["ddp_weights"], weights):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert losses[-1] < losses[0]  # it trained


def test_dropout_masks_differ_between_ranks_and_repeat_under_a_seed(ranks):
    assert all(r["mask_repeats"] for r in ranks)
    assert ranks[0]["masks_differ"]


def test_fsdp2_trains_a_patched_gpt2_block_like_one_process(ranks):
    pytest.importorskip("transformers")
    xs, ys = _block_data()
    losses = _train(_Hidden(_gpt2_block()), xs, ys)
    assert losses[-1] < losses[0]
    for r in ranks:
        torch.testing.assert_close(torch.tensor(r["gpt2_fsdp_losses"]), torch.tensor(losses), rtol=1e-10, atol=1e-12)


def test_fsdp2_trains_like_one_process(ranks):
    losses, _ = _single_process()
    for r in ranks:
        torch.testing.assert_close(torch.tensor(r["fsdp_losses"]), torch.tensor(losses), rtol=1e-10, atol=1e-12)
