"""The MLP blocks bench_mlp.py times: the real models' sizes, the module a user writes, the entries
(PyTorch, compile, the ops composed, fused_mlp per backend, Liger, the GEMMs alone), their check against
the float64 reference, and what a training forward keeps for backward.

Liger-Kernel (``liger_kernel``, where it imports; its wheel needs only torch and triton) serves the gated
blocks it has a module for, by its public classes: ``LigerSwiGLUMLP`` (swiglu: down(silu(gate(x)) *
up(x)), the product in one Triton kernel each way) and ``LigerGEGLUMLP`` (geglu_tanh: its GELU is the
tanh form, as Gemma's). Each is built on the meta device (no weights of its own) and given the plain
module's three Linears, so it computes with the same weights."""

from __future__ import annotations

import argparse
import contextlib
import functools
import types
from typing import Callable, ContextManager, NamedTuple, Optional, Union

import common
import torch
from torch import Tensor, nn

from dispatch import timing
from dispatch.contracts.activations import GATES

BLOCKS = {  # name -> (H, F, activation, dropout between the projections)
    "gpt2": (768, 3072, "gelu_tanh", 0.0),
    "vit-b": (768, 3072, "gelu", 0.1),
    "bert-large": (1024, 4096, "gelu", 0.1),
    "qwen2-0.5b": (896, 4864, "swiglu", 0.0),
    "llama-2-7b": (4096, 11008, "swiglu", 0.0),
    "gemma-2b": (2048, 16384, "geglu_tanh", 0.0),
}
QUICK = ("gpt2", "qwen2-0.5b", "llama-2-7b")
LIGER = {"swiglu": "LigerSwiGLUMLP", "geglu_tanh": "LigerGEGLUMLP"}  # activation -> Liger's module
SMOKE_M, SMOKE_H, SMOKE_F = 64, 32, 64
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MODES = ("forward+backward", "forward")
TORCH_ACTS = {"gelu_tanh": lambda: nn.GELU("tanh"), "gelu": nn.GELU, "silu": nn.SiLU, "relu": nn.ReLU}
FLOOR = "torch.mm"


class PlainMLP(nn.Module):
    """The block as a user writes it: fc1 -> act -> dropout -> fc2, or LLaMA's gate/up/down."""

    def __init__(self, h: int, f: int, activation: str, p: float) -> None:
        super().__init__()
        self.gated = activation in GATES
        self.act = TORCH_ACTS[GATES.get(activation, activation)]()
        if self.gated:
            self.gate_proj, self.up_proj = nn.Linear(h, f, bias=False), nn.Linear(h, f, bias=False)
            self.down_proj = nn.Linear(f, h, bias=False)
        else:
            self.fc1, self.fc2 = nn.Linear(h, f), nn.Linear(f, h)
        self.set_dropout(p)

    def set_dropout(self, p: float) -> None:
        self.drop = nn.Dropout(p) if p > 0 else nn.Identity()

    def weights(self) -> tuple[Tensor, ...]:
        """Its parameters in fused_mlp's order, a gate's (gate, up) in place of the stacked w_in."""
        if self.gated:
            return self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight
        return self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias

    def forward(self, x: Tensor) -> Tensor:
        if self.gated:
            return self.down_proj(self.drop(self.act(self.gate_proj(x)) * self.up_proj(x)))
        return self.fc2(self.drop(self.act(self.fc1(x))))


class Weights(NamedTuple):
    """fused_mlp's tensors: w_in (F, H), or for a gate (2F, H) stacked [gate; up] or the (gate, up)
    pair; biases or None."""

    w_in: Union[Tensor, tuple[Tensor, Tensor]]
    b_in: Optional[Tensor]
    w_out: Tensor
    b_out: Optional[Tensor]

    @property
    def present(self) -> tuple[Tensor, ...]:
        """The tensors, a pair's two in place of w_in."""
        pair = self.w_in if isinstance(self.w_in, tuple) else (self.w_in,)
        return tuple(t for t in (*pair, *self[1:]) if t is not None)

    @property
    def pair(self) -> bool:
        return isinstance(self.w_in, tuple)

    def stacked(self) -> Tensor:
        """w_in as one (F, H) or (2F, H) tensor, detached."""
        return (torch.cat(self.w_in) if self.pair else self.w_in).detach()  # type: ignore[arg-type]


class Entry(NamedTuple):
    fn: Callable[[Tensor], Tensor]
    params: tuple[Tensor, ...]  # the leaves a training step differentiates besides x
    split: bool  # params[:2] are (gate, up), the halves of the stacked w_in
    context: Callable[[], ContextManager] = contextlib.nullcontext  # around forward and backward


class Models(NamedTuple):
    """One block's contenders, sharing one set of weights (liger and compile wrap the same Linears)."""

    module: PlainMLP
    compiled: Callable
    liger: Optional[nn.Module]
    weights: Weights
    activation: str


# ----------------------------------------------------------------------------- entries


def device_of(p: argparse.ArgumentParser, args) -> torch.device:
    """The device a bench_mlp-style run measures on: the CPU with ``--cpu-smoke`` (one thread, tagged
    cpu_smoke), else CUDA, or the parser's error naming the flag."""
    args.tag = args.tag or ("cpu_smoke" if args.cpu_smoke else "")
    device = common.setup(args)
    if args.cpu_smoke:
        torch.set_num_threads(args.threads or 1)  # tiny matmuls: more threads only contend
        return torch.device("cpu")
    if device.type != "cuda":
        p.error("no CUDA device: run with --cpu-smoke for a smoke run of tiny sizes")
    return device


@functools.cache
def liger_version() -> tuple[bool, str]:
    """(True, version) where liger_kernel's transformers modules import, else (False, why not)."""
    try:
        import importlib.metadata

        import liger_kernel.transformers  # noqa: F401
    except Exception as exc:  # not installed, or its triton / torch pins disagree with ours
        return False, f"liger_kernel does not import: {timing.describe(exc)}"
    try:
        return True, importlib.metadata.version("liger-kernel")
    except importlib.metadata.PackageNotFoundError:
        return True, "unknown"


def liger_block(module: PlainMLP, activation: str, device) -> tuple[Optional[nn.Module], str]:
    """Liger's module for ``activation`` over ``module``'s own Linears, or (None, why there is none)."""
    if activation not in LIGER:
        return None, f"Liger has no MLP module for {activation} (it has {', '.join(LIGER)})"
    ok, version = liger_version()
    if not ok:
        return None, version
    if device.type != "cuda":
        return None, "liger's kernels are Triton's: they need CUDA"
    import liger_kernel.transformers as liger

    h, f = module.down_proj.out_features, module.down_proj.in_features
    config = types.SimpleNamespace(hidden_size=h, intermediate_size=f, hidden_act="silu")  # what they read
    with torch.device("meta"):  # its own Linears are replaced: no weights allocated or initialized
        block = getattr(liger, LIGER[activation])(config)
    for name in ("gate_proj", "up_proj", "down_proj"):  # the same Linears: the same weights
        setattr(block, name, getattr(module, name))
    return block, ""


def build(h: int, f: int, activation: str, p: float, dtype, device, args) -> tuple[Models, str]:
    """The block's models (random init, seeded) and why liger has none ('' when it has one). A gate's
    fused_mlp weight is a stacked copy of the module's gate and up weights, or with ``--gate-pair``
    the module's own two."""
    torch.manual_seed(0)
    module = PlainMLP(h, f, activation, p).to(device, dtype)
    torch._dynamo.reset()  # each block compiles afresh, static shapes: no recompile limit, no dynamic graph
    options = {} if args.compile_mode == "default" else {"mode": args.compile_mode}
    compiled = torch.compile(module, dynamic=False, **options)
    w = module.weights()
    if module.gated:
        w_in = (w[0], w[1]) if args.gate_pair else torch.cat(w[:2]).detach().requires_grad_()
        weights = Weights(w_in, None, w[2], None)
    else:
        weights = Weights(*w)
    liger, why = liger_block(module, activation, device) if module.gated else (None, "")
    return Models(module, compiled, liger, weights, activation), why


def composed(w: Weights, activation: str, p: float, training: bool) -> Callable[[Tensor], Tensor]:
    """fused_linear -> fused_bias_act_dropout -> fused_linear; with dropout the first GEMM runs without
    its bias, which moves into the dropout's pass, as dispatch.patch does."""
    from dispatch import fused_bias_act_dropout, fused_linear

    if p > 0 and training:
        return lambda x: fused_linear(
            fused_bias_act_dropout(fused_linear(x, w.w_in), w.b_in, activation, p), w.w_out, w.b_out
        )
    return lambda x: fused_linear(fused_linear(x, w.w_in, w.b_in, activation), w.w_out, w.b_out)


def mlp(w: Weights, activation: str, p: float, training: bool, backend: Optional[str]) -> Callable:
    from dispatch import fused_mlp

    return lambda x: fused_mlp(x, *w, activation, p, 0.0, training, backend=backend)


def variant(name: str) -> ContextManager:
    """Triton's fused_mlp forced into one of its variants (``fused_mlp.VARIANTS``), forward and backward."""
    from dispatch.backends.triton import fused_mlp as triton_mlp

    return triton_mlp.options(variant=name)


def entries(models: Models, p: float, training: bool, backends: list[str]) -> dict[str, Entry]:
    """Every contender at dropout ``p`` (the module's own dropout set to it) in training or eval mode."""
    module, w, act = models.module, models.weights, models.activation
    module.set_dropout(p)
    module.train(training)
    own = module.weights()
    out = {"pytorch": Entry(module, own, module.gated), "compile": Entry(models.compiled, own, module.gated)}
    if not module.gated:
        out["composed"] = Entry(composed(w, act, p, training), w.present, False)
    for name in (*backends, None):
        out[f"mlp/{name or 'dispatch'}"] = Entry(mlp(w, act, p, training, name), w.present, w.pair)
    if "triton" in backends:  # the variant with the passes in the GEMMs' epilogues
        fn = mlp(w, act, p, training, "triton")
        out["mlp/triton+epilogues"] = Entry(fn, w.present, w.pair, functools.partial(variant, "epilogues"))
        out["mlp/triton+keep"] = Entry(fn, w.present, w.pair, functools.partial(variant, "keep"))
        if act == "gelu_tanh" and p == 0:  # the default is "cublaslt" here where nvmath is installed
            out["mlp/triton+passes"] = Entry(fn, w.present, w.pair, functools.partial(variant, "passes"))
        # under torch.compile with a backend named the block is one opaque custom op: against
        # "compile" (inductor's own graph of the module) this decides where fused_mlp traces as what
        opaque = torch.compile(mlp(w, act, p, training, "triton"), fullgraph=True, dynamic=False)
        out["compile+mlp/triton"] = Entry(opaque, w.present, w.pair)
    # a patched model's block under torch.compile, no backend named: the compile rule decides (opaque
    # triton or math, dispatch.compiling.opaque_mlp); against "compile" the rule's effect, as measured
    out["compile+patched"] = Entry(torch.compile(patched(module, act, p).train(training), dynamic=False), own,
                                   module.gated)  # fmt: skip
    if models.liger is not None and p == 0:
        out["liger"] = Entry(models.liger, own, True)
    return out


def patched(module: PlainMLP, activation: str, p: float) -> nn.Module:
    """The FusedMLP dispatch.patch would make of the block: its own linear layers, adopted."""
    from dispatch.nn import FusedMLP

    if module.gated:
        names = ("gate_proj", "up_proj", "down_proj")
        return FusedMLP.from_linears((module.gate_proj, module.up_proj), activation, module.down_proj, p,
                                     names=names)  # fmt: skip
    return FusedMLP.from_linears(module.fc1, activation, module.fc2, p)


def step(e: Entry, x: Tensor, gy: Tensor, mode: str) -> timing.Fn:
    """What a row times: the forward under no_grad, or forward and the gradients of x and every weight."""
    if mode == "forward":

        def run():
            with torch.no_grad(), e.context():
                return e.fn(x)

        return run
    leaves = (x, *e.params)

    def train():
        with e.context():
            return torch.autograd.grad(e.fn(x), leaves, gy)

    return train


def gemm_floor(w: Weights, x: Tensor, gy: Tensor, mode: str) -> timing.Fn:
    """The block's GEMMs alone: x W_in^T and a W_out^T; backward gy W_out, gy^T a, g W_in and g^T x,
    g the (M, F) or (M, 2F) gradient of the pre-activation."""
    w_in, w_out, xd = w.stacked(), w.w_out.detach(), x.detach()
    a = torch.randn(x.shape[0], w_out.shape[1], device=x.device, dtype=x.dtype)  # (M, F)
    g = torch.randn(x.shape[0], w_in.shape[0], device=x.device, dtype=x.dtype)  # (M, F) or (M, 2F)

    def forward():
        return torch.mm(xd, w_in.t()), torch.mm(a, w_out.t())

    if mode == "forward":
        return forward

    def training():
        return forward(), torch.mm(gy, w_out), torch.mm(gy.t(), a), torch.mm(g, w_in), torch.mm(g.t(), xd)

    return training


# ----------------------------------------------------------------------------- checks and memory


def results(e: Entry, x: Tensor, gy: Tensor, training: bool) -> list[Tensor]:
    """Output, then (training) the gradients of x, w_in (a gate's halves stacked), b_in, w_out, b_out."""
    if not training:
        with torch.no_grad(), e.context():
            return [e.fn(x)]
    with e.context():
        y = e.fn(x)
        grads = list(torch.autograd.grad(y, (x, *e.params), gy))
    if e.split:
        grads[1:3] = [torch.cat(grads[1:3])]
    return [y.detach(), *grads]


def validate(found: dict[str, Entry], models: Models, x: Tensor, gy: Tensor, training: bool) -> dict:
    """'ok' or what missed, per entry: max error against the float64 reference (dispatch.ops.fused_mlp's
    ``reference``) at most twice the pytorch entry's plus the dtype's tolerance."""
    from dispatch.contracts.tolerances import allowed_error, max_error
    from dispatch.ops.fused_mlp import MLPOperands, reference

    w = models.weights
    tensors = (x, w.stacked(), *w[1:])
    x64, w_in, b_in, w_out, b_out = (None if t is None else t.detach().double() for t in tensors)
    leaves = [t.requires_grad_(training) for t in (x64, w_in, b_in, w_out, b_out) if t is not None]
    with torch.set_grad_enabled(training):
        y = reference(MLPOperands(x64, w_in, None, b_in, None, w_out, b_out, models.activation, 0.0, 0.0))
    ref = [y.detach(), *(torch.autograd.grad(y, leaves, gy.double()) if training else ())]
    names = ["y"]
    if training:
        grads = ("grad_x", "grad_w_in", "grad_b_in", "grad_w_out", "grad_b_out")
        names += [n for n, t in zip(grads, tensors) if t is not None]
    base: Optional[list[Tensor]] = None
    out = {}
    for name, e in sorted(found.items(), key=lambda kv: kv[0] != "pytorch"):
        try:
            got = results(e, x, gy, training)
        except Exception as exc:  # one entry failing must not end the row
            out[name] = f"error: {timing.describe(exc)}"
            continue
        base = got if name == "pytorch" else base
        bad = []
        for i, (what, g, r) in enumerate(zip(names, got, ref)):
            err, allowed = max_error(g, r), allowed_error(r, g.dtype, None if base is None else base[i])
            if not err <= allowed:
                bad.append(f"{what} err {err:.3g} > {allowed:.3g}")
        out[name] = "; ".join(bad) or "ok"
    return out


def saved_mib(e: Entry, x: Tensor) -> float:
    """MiB of the tensors a training forward saves for backward, each storage once, parameters and x
    left out."""
    skip = {t.untyped_storage().data_ptr() for t in (x, *e.params)}
    sizes: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            sizes[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), e.context():
        y = e.fn(x)
    del y
    return sum(sizes.values()) / 2**20


def held_mib(e: Entry, x: Tensor) -> float:
    """CUDA memory a training forward leaves allocated, the output's own bytes subtracted, in MiB."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with e.context():
        y = e.fn(x)
    held = torch.cuda.memory_allocated() - before - y.untyped_storage().nbytes()
    del y
    return held / 2**20


# ----------------------------------------------------------------------------- a row
