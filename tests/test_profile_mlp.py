"""benchmarks/profile_mlp.py: a CPU smoke run writes a row per block whose categories add up to each
entry's total, and GPU kernel names land in the categories its docstring gives them."""

import importlib
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = os.path.join(ROOT, "benchmarks")
CATEGORIES = ("products", "passes", "pointwise", "reductions", "copies", "other")


@pytest.fixture
def profile_mlp(monkeypatch):
    monkeypatch.syspath_prepend(BENCHMARKS)  # the benchmarks import their ``common`` as scripts do
    return importlib.import_module("profile_mlp")


def test_the_cpu_smoke_run_writes_a_row_per_block_whose_categories_add_up(tmp_path):
    """Two blocks, one gated: every profiled entry has each category, a total > 0 and categories that
    sum to it within 1%; the floor is profiled and zero over itself. ~6 s on a 2-core CPU."""
    blocks = ["gpt2", "qwen2-0.5b"]
    script = os.path.join(BENCHMARKS, "profile_mlp.py")
    done = subprocess.run(
        [sys.executable, script, "--cpu-smoke", "--blocks", ",".join(blocks), "--out", str(tmp_path)],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT}, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    result = json.loads((tmp_path / "profile_mlp-cpu_smoke.json").read_text())
    assert (tmp_path / "profile_mlp-cpu_smoke.log").exists()
    assert tuple(result["categories"]) == CATEGORIES
    rows = result["rows"]
    assert [r["block"] for r in rows] == blocks and all("error" not in r for r in rows), rows
    for r in rows:
        profiled = [k[len("us:") :] for k in r if k.startswith("us:")]
        assert {"pytorch", "mlp/dispatch", "torch.mm"} <= set(profiled), (r["block"], profiled)
        for name in profiled:
            total = r[f"us:{name}"]
            parts = [r[f"{c}_us:{name}"] for c in CATEGORIES]
            assert total > 0 and min(parts) >= 0, (r["block"], name, total, parts)
            assert abs(sum(parts) - total) <= 0.01 * total, (r["block"], name, total, parts)
            assert r[f"launches:{name}"] > 0 and f"over_floor_us:{name}" in r
        assert r["products_us:torch.mm"] > 0 and r["over_floor_us:torch.mm"] == 0
        assert r["skip:compile"] == "--cpu-smoke: no compile entries"
    assert "entry" in done.stdout and "over floor us" in done.stdout  # the tables were printed


def test_kernel_names_fall_into_their_categories(profile_mlp):
    """cuBLAS, CUTLASS and this project's Triton GEMMs are products; its other Triton kernels,
    inductor's and Liger's are passes; ATen's kernels by kind; CPU ops by name."""
    gemms, passes = profile_mlp.triton_kernels()
    assert {"_matmul_kernel", "_up_kernel", "_grad_kernel"} <= gemms
    assert "_gate_forward_kernel" in passes and not gemms & passes
    cases = {
        "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT": "products",
        "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn>": "products",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64": "products",
        "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>": "products",
        "_matmul_tma_kernel": "products",
        "_gate_forward_kernel": "passes",
        "triton_poi_fused__to_copy_gelu_0": "passes",
        "_swiglu_forward_kernel": "passes",
        "void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl>": "pointwise",
        "void at::native::(anonymous namespace)::fused_dropout_kernel_vec<c10::BFloat16>": "pointwise",
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<c10::BFloat16>>": "reductions",
        "Memset (Device)": "copies",
        "void at::native::CatArrayBatchedCopy<c10::BFloat16, unsigned int, 2, 128, 1>": "copies",
        "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda>": "copies",
        "void some_other_library_kernel<float>": "other",
    }
    assert {n: profile_mlp.categorize(n, True) for n in cases} == cases
    ops = {"aten::addmm": "products", "aten::linear": "products", "aten::gelu_backward": "pointwise",
           "aten::sum": "reductions", "aten::cat": "copies", "aten::t": "other",
           "MmBackward0": "other"}  # fmt: skip
    assert {n: profile_mlp.categorize(n, False) for n in ops} == ops
