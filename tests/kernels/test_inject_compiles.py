"""The fused kernel compiles for a Hopper GPU (sm_90: H100/H200) on a machine without one.

Triton's wheel carries ptxas, so the whole compile path (Triton IR → PTX → cubin) runs on CPU. This catches what
the interpreter cannot: type rules of the compiled frontend (bitcasts, unsigned literals, constexpr dtypes) and
register/shared-memory limits, for every variant the dispatcher launches.
"""

import shutil
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from inferscale.kernels.inject_triton import BLOCK_T, _inject_kernel  # noqa: E402

PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
pytestmark = pytest.mark.skipif(not PTXAS.exists() and not shutil.which("ptxas"), reason="no ptxas in this triton")

POINTERS = ("src", "scale", "dst", "src_layers", "dst_layers", "src_tokens", "dst_positions", "rot_rows", "cos_tab",
            "sin_tab", "page_table")


def _compile(src_ty: str, dst_ty: str, has_scale: bool, move_values: bool, block_d: int):
    names = _inject_kernel.arg_names
    consts = {"HAS_SCALE": has_scale, "MOVE_VALUES": move_values, "BLOCK_T": BLOCK_T, "BLOCK_D": block_d}
    types = {"src": src_ty, "dst": dst_ty, "scale": "*fp32", "cos_tab": "*fp32", "sin_tab": "*fp32"}
    sig = {n: ("constexpr" if n in consts else types.get(n, "*i32") if n in POINTERS else "i32") for n in names}
    src = ASTSource(fn=_inject_kernel, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": False})


@pytest.mark.parametrize("src_ty, dst_ty, has_scale, move_values, block_d", [
    ("*bf16", "*bf16", False, True, 64),  # head_dim 128, bf16 cache
    ("*fp16", "*fp16", False, True, 32),  # head_dim 64
    ("*fp32", "*fp32", False, False, 64),  # the engine's in-place rotation
    ("*i8", "*bf16", True, True, 64),  # compact int8 blocks with scales
])
def test_kernel_compiles_for_sm90(src_ty, dst_ty, has_scale, move_values, block_d):
    kernel = _compile(src_ty, dst_ty, has_scale, move_values, block_d)
    assert kernel.asm["cubin"] and ".target sm_90" in kernel.asm["ptx"]
    assert "fma.rn.f32" not in kernel.asm["ptx"]  # no contraction: rounding matches the torch reference
