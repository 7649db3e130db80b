"""``python -m inferscale.kernels``: build every CPU kernel this machine runs into the cache, ahead of the first model
load (``scripts/setup.sh``, and the server image's model step, whose pods then load them without compiling:
``cppext.py``). Each kernel's own ``python -m`` prints whether it was built or why aten's operations stay."""

from __future__ import annotations

import runpy

# The decode kernels (AMX, else AVX512-BF16, else AVX2 only), the norms, the MLP's activation, attention, injection
# and the embedder's float32 products; a kernel this CPU cannot run says so and is skipped.
KERNELS = ("amx_linear", "bf16_linear", "avx2_linear", "rms_norm", "gelu_mul", "row_attention", "rotate_place",
           "f32_linear")

if __name__ == "__main__":
    for name in KERNELS:
        runpy.run_module(f"inferscale.kernels.{name}", run_name="__main__")
