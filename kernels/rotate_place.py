"""``rotate_place``: a kv request's memory blocks (and the shared prefix) written straight into its slot of the slot
cache in one pass, keys rotated into place (``rotate_place.cpp``), with the torch path's numbers bit for bit.

The torch path (``engine/cache.py``'s ``injected_groups`` then ``SlotCache.write_groups``) concatenates each layer
group's blocks, converts their keys to float32, multiplies, adds twice with ``addcmul_``, casts back and copies the
result into the slot: ~7.7 ms of a k=20 request's question pass on the 2-core Zen 3 machine, for ~7 MB of K/V
(issue 22: this is kv mode's own time, which text mode does not spend). The kernel reads each block once and writes
its slot once.

``load()`` hands the operator out only after checking, on random blocks, that its slot contents equal the torch
path's (``reference``) here: aten's ``addcmul_`` contracts its multiply-add on these builds, and a build that did not
would disagree and keep the torch path. None also on CPUs without AVX2 and FMA, where the build fails, or with
``INFERSCALE_ROTATE_PLACE=0``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from inferscale.cpuflags import cpu_flags
from inferscale.kernels import cppext
from inferscale.kernels.rope import rope_shift, shift_cos_sin

SOURCE = Path(__file__).with_name("rotate_place.cpp")
# FMA: addcmul_'s fused multiply-add in one instruction; no contraction elsewhere (k * cos is rounded on its own).
FLAGS = ["-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp"]

# (dst_keys, dst_values, slot, start, sources, skips, layers, cos, sin, rotated_from) -> None; rotate_place.cpp
RotatePlace = Callable[[list[torch.Tensor], list[torch.Tensor], int, int, list[torch.Tensor], list[int], list[int],
                        torch.Tensor, torch.Tensor, int], None]


@functools.cache
def load() -> RotatePlace | None:
    """The operator once built and checked here; None where the torch path stays."""
    if not cppext.built(SOURCE, FLAGS if {"avx2", "fma"} <= cpu_flags() else None, "INFERSCALE_ROTATE_PLACE"):
        return None
    return cppext.checked(torch.ops.inferscale_inject.rotate_place, agrees,
                          "rotate_place's keys differ from the torch path's here; injection stays on torch")


def rotations(deltas: Sequence[int], inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [len(deltas), D] float32, one row per rotated source: rope's own angles (float64, then float32)."""
    if not deltas:
        empty = torch.empty(0, 2 * inv_freq.numel())
        return empty, empty.clone()
    cos, sin = shift_cos_sin(torch.tensor(list(deltas), dtype=torch.long), inv_freq.cpu())
    return cos.contiguous(), sin.contiguous()


def reference(dst_keys: list[torch.Tensor], dst_values: list[torch.Tensor], slot: int, start: int,
              sources: list[torch.Tensor], skips: list[int], layers: list[int], deltas: list[int | None],
              inv_freq: torch.Tensor) -> None:
    """What the kernel writes, through rope_shift (None: a source copied as it is, the prefix)."""
    pos = start
    for src, skip, delta in zip(sources, skips, deltas):
        n = src.shape[3] - skip
        for j, layer in enumerate(layers):
            keys = src[layer, 0, :, skip:]
            if delta is not None:
                keys = rope_shift(keys.clone(), torch.full((n,), delta), inv_freq, inplace=True)
            dst_keys[j][slot, :, pos:pos + n] = keys
            dst_values[j][slot, :, pos:pos + n] = src[layer, 1, :, skip:]
        pos += n


def agrees(op: RotatePlace) -> bool:
    """The kernel's slots equal ``reference``'s for random blocks: a prefix copied from a skip, blocks rotated by
    negative, zero and large deltas, two key heads, every other layer, values of several magnitudes."""
    gen = torch.Generator().manual_seed(0)
    layers_total, heads, dim, capacity = 6, 2, 256, 400
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    sources = [(torch.randn(layers_total, 2, heads, n, dim, generator=gen) * scale).to(torch.bfloat16)
               for n, scale in ((30, 1.0), (17, 40.0), (1, 1e-3), (45, 3.0), (9, 1.0))]
    skips, deltas, layers = [4, 0, 0, 5, 2], [None, -7, 0, 250, 100_000], [0, 2, 3, 5]
    got = [[torch.zeros(3, heads, capacity, dim, dtype=torch.bfloat16) for _ in layers] for _ in range(2)]
    want = [[t.clone() for t in kv] for kv in got]
    cos, sin = rotations(deltas[1:], inv_freq)
    op(got[0], got[1], 1, 11, sources, skips, layers, cos, sin, 1)
    reference(want[0], want[1], 1, 11, sources, skips, layers, deltas, inv_freq)
    return all(torch.equal(a, b) for a, b in zip(got[0] + got[1], want[0] + want[1]))


if __name__ == "__main__":  # scripts/setup.sh builds it ahead of the first model load
    print("rotate_place:", "built" if load() is not None else "not available here (torch injection is used)",
          cppext.build_dir(SOURCE, FLAGS))
