"""Drop-in modules over the fused ops: ``FusedLinear``, ``FusedBiasActDropout``, ``FusedMLP`` and the
norms ``FusedRMSNorm`` and ``FusedLayerNorm`` (``norm.py``: each takes the residual add before it).

``FusedLinear`` is ``nn.Linear`` followed by an activation and, with ``dropout=p``, a dropout: same
parameters (``weight`` (out, in), ``bias`` (out,)), same initialization, so an ``nn.Linear`` state_dict
loads unchanged. With ``transposed=True`` it stores the weight (in, out) as Hugging Face's ``Conv1D``
does (whose state_dict then loads unchanged) and passes the op its transposed view: cuBLAS and the
Triton kernels read either layout in place, and under ``torch.compile`` the GEMMs are the Conv1D's own.
``FusedBiasActDropout`` owns a bias and computes Dropout(Activation(x + bias)) in one pass.
``FusedMLP`` is a whole MLP block, Linear -> activation (or a gate) -> Dropout -> Linear -> Dropout, in
one ``fused_mlp`` call; its projections are child modules it can adopt from an existing block.

Autocast: under ``torch.autocast`` for x's device type with a half dtype (float16, bfloat16), x,
weights and biases are cast to that dtype first, as ``nn.Linear`` does (float64 tensors are left alone,
as autocast leaves them); the output has that dtype. ``FusedBiasActDropout`` casts its bias to x's
dtype, whatever x is: the fused op needs one dtype, and x carries the precision the model chose.

torch.compile: the modules compile with ``fullgraph=True``; with no backend requested their ops are
traced as plain math that inductor fuses (dropout with inductor's mask), else each op is one
custom-op node (each op's ``torch.library`` registration in ``dispatch/ops/<op>.py``).

CUDA graphs: dropout draws its ``[seed, offset]`` pair from the device's default generator
(``dispatch/contracts/rng.py``). Under ``torch.cuda.graph`` capture torch registers that generator with
the graph and advances it on every replay, so each replay draws a new pair and gets a new mask; a
backward captured in the same graph regenerates its forward's mask from the same pair
(``tests/test_nn.py::test_cuda_graph_replays_draw_new_masks``). Nothing is read back to the host, so
capture never synchronizes. ``model.eval()`` (or p = 0) draws nothing and drops nothing.
"""

from dispatch.nn.layers import FusedBiasActDropout, FusedLinear, is_conv1d, linear_layout
from dispatch.nn.mlp import FusedMLP
from dispatch.nn.norm import FusedLayerNorm, FusedRMSNorm

__all__ = [
    "FusedBiasActDropout", "FusedLayerNorm", "FusedLinear", "FusedMLP", "FusedRMSNorm", "is_conv1d",
    "linear_layout",
]  # fmt: skip
