"""Linear layers as ``weight @ x.T`` where that gives the same numbers faster: decode's few rows (issue 22).

``F.linear(x, W)`` on a bf16 CPU model runs oneDNN's AMX matmul with ``W`` [out, in] as the *weights* operand,
which oneDNN repacks into its blocked layout on every call: per decode step that is every weight byte read and
written again (Gemma-3-270M: the 335 MB tied LM head and 200 MB of layers). ``torch.mm(W, x.T)`` (``torch.mv`` for
one row) runs the same oneDNN primitive (``brg_matmul:avx10_1_512_amx``, see ONEDNN_VERBOSE) with the roles
swapped: ``W`` is the source, read in place, and only the few activation rows are packed. Measured on the 2-core
AMX machine, one thread, CPU time (min of 9): LM head 26-28 ms vs 44-50 ms, the 126 layer projections 23 ms vs
35-38 ms, against 26 ms / 17 ms for a float32 read of the same bytes; batch 1 and 16 alike.

Each output is the same in-features-long dot product accumulated in the same order, so the results are bit for
bit ``F.linear``'s (0 of 29 M LM-head logits differed, 1 to 32 rows; at 33 rows and more F.linear changes kernel
and differs from its own one-row results, so those stay on F.linear). Only up to ``MAX_ROWS`` rows (decode
batches, short prompt chunks) take this path; longer inputs (prefill, encoding) are compute-bound and keep
``F.linear``. The swap is made only after that equality is checked on the loaded weights' shapes at load time
(``CHECK_ROWS``); on any other backend, dtype or device the model keeps its ``nn.Linear`` modules.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)
# Up to 32 rows F.linear itself gives each row what one row alone gets (above, oneDNN picks another kernel and
# the numbers change): that is the range checked equal and swapped.
MAX_ROWS = 32
CHECK_ROWS = (1, 3, 17, MAX_ROWS)  # row counts the equality is checked at, per weight shape


class WeightMajorLinear(torch.nn.Module):
    """``nn.Linear``'s result computed as ``(W @ x.T).T`` for up to MAX_ROWS rows; shares the original's
    parameters (ties stay tied, the state dict keeps its names)."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        rows = flat.shape[0]
        if rows > MAX_ROWS:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        if rows == 1:  # oneDNN's matmul with a [in, 1] operand is slower than mv here
            out = torch.mv(self.weight, flat[0])[None]
        else:
            out = torch.mm(self.weight, flat.t()).t().contiguous()
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


def install_weight_major_linears(model: torch.nn.Module) -> int:
    """Replace every ``nn.Linear`` of a bf16 CPU ``model`` by a ``WeightMajorLinear``, once the two are checked to
    give identical outputs here; returns how many were replaced (0: none, the model is unchanged)."""
    linears = [(name, mod) for name, mod in model.named_modules() if type(mod) is torch.nn.Linear]
    if not linears or any(m.weight.device.type != "cpu" or m.weight.dtype != torch.bfloat16 for _, m in linears):
        return 0
    checked: dict[tuple[int, int, bool], bool] = {}
    for _, mod in linears:
        key = (mod.out_features, mod.in_features, mod.bias is not None)
        if key not in checked:
            checked[key] = _same_outputs(mod)
    if not all(checked.values()):
        log.info("weight @ x.T differs from F.linear on this machine; keeping nn.Linear")
        return 0
    for name, mod in linears:
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, WeightMajorLinear(mod))
    return len(linears)


def _same_outputs(linear: torch.nn.Linear) -> bool:
    fast = WeightMajorLinear(linear)
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for rows in CHECK_ROWS:
            x = torch.randn(rows, linear.in_features, generator=gen).to(linear.weight.dtype)
            if not torch.equal(fast(x), linear(x)):
                return False
    return True
