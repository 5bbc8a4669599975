"""The Triton kernels compiled for a CUDA GPU (sm_90) on a host without one: what the
interpreter lets through (non-constexpr globals, unsupported ops, tl.dot shape rules) and
shared memory beyond an H100/H200's, at the configs the launchers pick. On a GPU host the
other tests compile every kernel for real, so scripts/gpu-check.sh leaves this file out."""

import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import triton

# Runs in a child process without TRITON_INTERPRET, so @triton.jit builds real JITFunctions.
# It compiles every kernel down to an sm_90 cubin (Triton ships ptxas), which catches what
# the interpreter lets through: non-constexpr globals, unsupported ops, tl.dot shape rules;
# with the specializations a real launch gets (unit strides, 16-aligned pointers and
# strides), so the loads pipeline and the shared memory checked is what a launch needs.
_COMPILE_SCRIPT = """
import inspect, sys
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from pagedserve.kernels.triton import cache_ops as tk
from pagedserve.kernels.triton import decode as td
from pagedserve.kernels.triton import elementwise as te
from pagedserve.kernels.triton import prefill as tp
from pagedserve.kernels.triton.common import VARYING_ARGS, VARYING_POINTERS

FIXED_PTRS = {"block_tables_ptr": "*i32", "context_lens_ptr": "*i32",
              "cu_seqlens_q_ptr": "*i32", "slot_ptr": "*i64", "src_ptr": "*i64",
              "dst_ptr": "*i64", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32",
              "part_acc_ptr": "*fp32", "positions_ptr": "*i64", "cos_ptr": "*fp32",
              "sin_ptr": "*fp32"}
FLOATS = {"scale", "qk_scale", "eps"}
TORCH = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
SMEM = 232448  # an H100/H200's shared memory per block, in bytes


def kernels(dtype, d):
    # (kernel, constexprs, options) at the configs the launchers pick for head_dim d
    mode = 1 if dtype == "fp32" else 0  # common.dot_mode on a GPU
    tile, warps, stages = td.decode_config(d)
    dec = {"HEAD_DIM": d, "BLOCK_G": 16, "BLOCK_N": tile, "BLOCK_D": d, "DOT_MODE": mode,
           "BLOCK_SIZE": 16}
    dec_opts = {"num_warps": warps, "num_stages": stages}
    bm, bn, warps, stages = tp.prefill_config(d, TORCH[dtype])
    return [
        (tk._store_kvcache_kernel, {"BLOCK_H": 8, "BLOCK_D": d}, {}),
        (td._decode_kernel, {**dec, "SPLIT": False}, dec_opts),
        (td._decode_kernel, {**dec, "SPLIT": True}, dec_opts),
        (td._reduce_kernel, {"HEAD_DIM": d, "BLOCK_D": d, "BLOCK_S": 64}, {}),
        (tp._prefill_kernel, {"HEAD_DIM": d, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_D": d,
                              "DOT_MODE": mode, "BLOCK_SIZE": 16, "GROUP_P": 1, "FLAT": False},
         {"num_warps": warps, "num_stages": stages}),
        # The flat grid (a whole graph's), its group packed: Qwen2.5-0.5B's 7 heads padded
        # to 8 at d=64, Llama-3-8B's 4 at d=128.
        (tp._prefill_kernel, {"HEAD_DIM": d, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_D": d,
                              "DOT_MODE": mode, "BLOCK_SIZE": 16,
                              "GROUP_P": 8 if d == 64 else 4, "FLAT": True},
         {"num_warps": warps, "num_stages": stages}),
        (tk._copy_blocks_kernel, {"BLOCK": 4096}, {}),
    ] + ([] if d != 64 else [  # query heads packed (7 padded to 8), a config the sweep tries
        (tp._prefill_kernel, {"HEAD_DIM": d, "BLOCK_M": 128, "BLOCK_N": 32, "BLOCK_D": d,
                              "DOT_MODE": mode, "BLOCK_SIZE": 16, "GROUP_P": 8,
                              "FLAT": False},
         {"num_warps": 4, "num_stages": 2}),
    ]) + ([] if d != 128 else [  # the per-token ops: once per dtype is enough
        (te._rms_norm_kernel, {"HAS_RESIDUAL": True, "BLOCK": 8192}, {"num_warps": 16}),
        (te._rms_norm_kernel, {"HAS_RESIDUAL": False, "BLOCK": d}, {"num_warps": 1}),
        (te._rotary_kernel, {"BLOCK_H": 64, "BLOCK_HALF": d // 2}, {"num_warps": 16}),
        (te._silu_and_mul_kernel, {"BLOCK": 1024}, {"num_warps": 4}),
    ])


def unit_stride(name):
    # The innermost strides; a launch passes 1 there, which the JIT turns into a constant.
    return name == "stride_btn" or (name.startswith("stride_") and name.endswith("d"))


def aligned(name):
    # Pointers, the other cache/q/out strides and block_size are multiples of 16 at real
    # shapes, which the JIT passes on as alignment hints (vector loads, cp.async pipelining
    # and its shared-memory buffers depend on them); the kernels never specialize on the
    # step-dependent ones (common.VARYING_ARGS, VARYING_POINTERS).
    if name in VARYING_ARGS or name in VARYING_POINTERS:
        return False
    return name.endswith("_ptr") or name in ("block_size", "min_part") or (
        name.startswith("stride_"))


dtype, d = sys.argv[1], int(sys.argv[2])
for kernel, consts, options in kernels(dtype, d):
    names = list(inspect.signature(kernel.fn).parameters)
    consts = {**consts, **{n: 1 for n in names if unit_stride(n)}}
    sig, attrs = {}, {}
    for i, n in enumerate(names):
        if n in consts:
            sig[n] = "constexpr"
            continue
        if n.endswith("_ptr"):
            sig[n] = FIXED_PTRS.get(n, "*" + dtype)
        else:
            sig[n] = "fp32" if n in FLOATS else "i32"
        if aligned(n):
            attrs[(i,)] = [["tt.divisibility", 16]]
    constexprs = {(names.index(k),): v for k, v in consts.items()}
    src = ASTSource(kernel, sig, constexprs=constexprs, attrs=attrs)
    binary = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    assert binary.metadata.shared <= SMEM, (kernel.fn.__name__, dtype, d,
                                            binary.metadata.shared)
print("compiled")
"""


def test_kernels_compile_for_cuda(tmp_path) -> None:
    bundled_bin = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    if shutil.which("ptxas", path=str(bundled_bin)) is None:
        pytest.skip("this triton install has no bundled ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # a fresh cache: really compile
    repo_root = pathlib.Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo_root), env.get("PYTHONPATH")]))
    # One child per dtype and head size, at once: the builds are single-threaded. fp16 builds
    # as bf16 does (the same dot mode, tiles and shared memory): CI leaves it to a GPU's builds.
    children = [subprocess.Popen([sys.executable, "-c", _COMPILE_SCRIPT, dtype, str(d)],
                                 env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True)
                for dtype in ("bf16", "fp32") for d in (64, 128)]
    try:
        for child in children:
            out, err = child.communicate(timeout=300)
            assert child.returncode == 0 and "compiled" in out, err[-4000:]
    finally:
        for child in children:
            child.kill()
