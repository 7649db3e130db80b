"""The fused kernel compiles for a Hopper GPU (sm_90: H100/H200) on a machine without one.

Triton's wheel carries ptxas, so the whole compile path (Triton IR → PTX → cubin) runs on CPU. This catches what
the interpreter cannot: type rules of the compiled frontend (bitcasts, unsigned literals, constexpr dtypes) and
register/shared-memory limits, for every variant the dispatcher launches. It runs in a child process with
TRITON_INTERPRET=0: test_inject.py turns the interpreter on for this whole pytest process.
"""

import json
import os
import subprocess
import sys

import pytest

VARIANTS = [
    ("*bf16", "*bf16", False, True, 64),  # head_dim 128, bf16 cache
    ("*fp16", "*fp16", False, True, 32),  # head_dim 64
    ("*fp32", "*fp32", False, False, 64),  # the engine's in-place rotation
    ("*i8", "*bf16", True, True, 64),  # compact int8 blocks with scales
    ("*fp8e4nv", "*bf16", True, True, 64),  # compact fp8 (e4m3) blocks with scales (kvquant "fp8", sm_89+)
    ("*i8", "*fp32", True, True, 8),  # int8/int4 codes into a float32 cache (the CPU-shaped engine on CUDA)
]
POINTERS = ("src", "scale", "dst", "src_layers", "dst_layers", "src_tokens", "dst_positions", "rot_rows", "cos_tab",
            "sin_tab", "page_table")


def _compile_all(fusion: bool) -> list[dict]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from inferscale.kernels.inject_triton import BLOCK_T, _inject_kernel

    out = []
    names = _inject_kernel.arg_names
    for src_ty, dst_ty, has_scale, move_values, block_d in VARIANTS:
        consts = {"HAS_SCALE": has_scale, "MOVE_VALUES": move_values, "BLOCK_T": BLOCK_T, "BLOCK_D": block_d}
        types = {"src": src_ty, "dst": dst_ty, "scale": "*fp32", "cos_tab": "*fp32", "sin_tab": "*fp32"}
        sig = {n: ("constexpr" if n in consts else types.get(n, "*i32") if n in POINTERS else "i32") for n in names}
        src = ASTSource(fn=_inject_kernel, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()})
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": fusion})
        ptx = k.asm["ptx"]
        out.append({"variant": [src_ty, dst_ty], "cubin": len(k.asm["cubin"]), "sm90": ".target sm_90" in ptx,
                    "fma": "fma.rn.f32" in ptx})
    return out


def _run(fusion: bool) -> list[dict]:
    env = dict(os.environ, TRITON_INTERPRET="0")
    r = subprocess.run([sys.executable, __file__, "1" if fusion else "0"], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_kernel_compiles_for_sm90_without_fma_contraction():
    triton = pytest.importorskip("triton")
    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("this triton wheel carries no ptxas")
    results = _run(fusion=False)
    assert len(results) == len(VARIANTS)
    for r in results:
        assert r["cubin"] > 0 and r["sm90"], r
        assert not r["fma"], r  # as launched: no contraction, so rounding matches the torch reference
    # and the check can see contraction when it is there
    assert any(r["fma"] for r in _run(fusion=True))


if __name__ == "__main__":
    print(json.dumps(_compile_all(sys.argv[1] == "1")))
