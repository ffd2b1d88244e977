"""The fused kernels compile for a Hopper GPU (sm_90) even where no GPU exists.

The interpreter does not type-check like the compiler (operand types of atomics, loop-carried
types, inline assembly), so CI compiles the GPU build of every kernel with a spin loop in a
subprocess without ``TRITON_INTERPRET`` (Triton's bundled ptxas does the last step).
"""

import os
import subprocess
import sys

import pytest

from tests.harness import REPO_ROOT

BLOCKS = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64)


def _compile(fn, signature: dict, constexprs: dict) -> int:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(fn=fn, signature={**signature, **{k: "constexpr" for k in constexprs}},
                    constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
    return len(kernel.asm["cubin"])


def main() -> None:
    import triton.language as tl

    from kernels.fused import ag_gemm, gemm, gemm_ar, gemm_ar_w8a16, gemm_rs, signals

    i32, i64, f16, tab = "i32", "i64", "*fp16", "*i64"
    timer = dict(USE_GLOBALTIMER=True)
    acc = dict(ACC_DTYPE=tl.float32)
    dot = dict(DOT_PRECISION="tf32")
    sizes = [
        _compile(signals._check_call_kernel,
                 dict(sig_tab_ptr=tab, rank=i32, epoch=i64, timeout=i64, must_agree=i64,
                      **{f"d{i}": i64 for i in range(13)}),
                 dict(WORLD=4, DESC_LEN=13, DESC_OFFSET=100, **timer)),
        _compile(signals._finish_call_kernel,
                 dict(sig_tab_ptr=tab, out0_ptr=f16, n0=i64, out1_ptr=f16, n1=i64, rank=i32, epoch=i64),
                 dict(WORLD=4, DONE_OFFSET=8, OUTPUTS=2, BLOCK=1024)),
        _compile(ag_gemm._push_shard_kernel,
                 dict(x_ptr=f16, data_tab_ptr=tab, sig_tab_ptr=tab, M_LOCAL=i32, K=i32, stride_xm=i32, stride_xk=i32,
                      chunk_rows=i32, n_chunks=i32, rank=i32, epoch=i64),
                 dict(WORLD=4, FLAG_OFFSET=12, FLAG_STRIDE=8, BLOCK_R=32, BLOCK_K=256)),
        _compile(ag_gemm._ag_gemm_kernel,
                 dict(data_tab_ptr=tab, sig_tab_ptr=tab, w_ptr=f16, bias_ptr=f16, y_ptr=f16, g_ptr=f16, M_LOCAL=i32,
                      N=i32, K=i32, n_tiles=i32, chunk_rows=i32, stride_wn=i32, stride_wk=i32, stride_ym=i32,
                      stride_yn=i32, rank=i32, epoch=i64, timeout=i64, flag_offset=i32),
                 dict(WORLD=4, CHANNEL=1, FLAG_STRIDE=8, HAS_BIAS=True, STORE_A=True, **timer, **acc, **dot,
                      **BLOCKS)),
        _compile(gemm_rs._gemm_scatter_kernel,
                 dict(x_ptr=f16, w_ptr=f16, data_tab_ptr=tab, sig_tab_ptr=tab, M=i32, N=i32, K=i32, ROWS_OWN=i32,
                      stride_xm=i32, stride_xk=i32, stride_wn=i32, stride_wk=i32, rank=i32, epoch=i64, timeout=i64,
                      done_offset=i32, cnt_offset=i32),
                 dict(WORLD=4, BROADCAST=True, **timer, **acc, **dot, **BLOCKS)),
        # fp32 with TF32 off (torch's default): the exact-fp32 dot.
        _compile(gemm._matmul_kernel,
                 dict(a_ptr="*fp32", b_ptr="*fp32", bias_ptr="*fp32", c_ptr="*fp32", M=i32, N=i32, K=i32,
                      stride_am=i32, stride_ak=i32, stride_bn=i32, stride_bk=i32, stride_cm=i32, stride_cn=i32),
                 dict(HAS_BIAS=True, ACC_DTYPE=tl.float32, DOT_PRECISION="ieee", **BLOCKS)),
        # The w8A16 scatter in the other (owner) mode, with the per-group scale gather.
        _compile(gemm_ar_w8a16._gemm_w8a16_scatter_kernel,
                 dict(x_ptr=f16, q_ptr="*i8", s_ptr=f16, o_ptr="*fp32", data_tab_ptr=tab, sig_tab_ptr=tab, M=i32,
                      N=i32, K=i32, ROWS_OWN=i32, GROUP_SIZE=i32, stride_xm=i32, stride_xk=i32, stride_qn=i32,
                      stride_qk=i32, stride_sn=i32, stride_sg=i32, rank=i32, epoch=i64, timeout=i64,
                      done_offset=i32, cnt_offset=i32),
                 dict(MODE=gemm_ar_w8a16.PER_GROUP, HAS_OFFSET=True, WORLD=4, BROADCAST=False, **timer, **BLOCKS)),
        _compile(gemm_rs._reduce_slots_kernel,
                 dict(data_tab_ptr=tab, sig_tab_ptr=tab, bias_ptr=f16, out_ptr=f16, ROWS_OWN=i32, ROWS_VALID=i32,
                      N=i32, stride_om=i32, stride_on=i32, rank=i32, epoch=i64, target=i64, timeout=i64,
                      cnt_offset=i32, done_offset=i32, push_offset=i32, push_base=i64),
                 dict(WORLD=4, CHANNEL=2, HAS_BIAS=True, PUSH=True, **timer, **acc, BLOCK_M=128, BLOCK_N=128)),
        _compile(gemm_ar._gather_rows_kernel,
                 dict(data_tab_ptr=tab, sig_tab_ptr=tab, out_ptr=f16, M=i32, N=i32, ROWS_OWN=i32, stride_om=i32,
                      stride_on=i32, rank=i32, target=i64, timeout=i64, o_base=i64, ar_offset=i32),
                 dict(WORLD=4, CHANNEL=3, **timer, BLOCK_M=128, BLOCK_N=128)),
    ]
    print("compiled", sizes)


def test_fused_kernels_compile_for_sm90():
    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        pytest.skip("Triton's bundled ptxas is missing")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run([sys.executable, "-c", "import tests.test_fused_compile as t; t.main()"], cwd=REPO_ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "compiled" in proc.stdout
