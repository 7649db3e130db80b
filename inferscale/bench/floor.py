"""The decode step's floor (issue 22): every weight byte read once, at the best read bandwidth measured now.

``bench load`` (through the server) and ``bench step`` (the engine alone) print their step times against it. The
bandwidth is that of a reduction over the model's largest weight (the embedding, which the LM head reads too), with
one thread or every core (the counts the engine's thread tuner picks between), whichever reads faster now: on a
shared machine it moves within minutes, so each measurement reads it beside its own steps.
"""

from __future__ import annotations

import statistics
import time

import torch

from inferscale.engine.threads import on_own_thread, pin_threads, usable_cores


def decode_floor(model: torch.nn.Module, torch_threads: int, reps: int = 5) -> dict:
    """``weight_bytes``, ``read_gb_per_s``, ``floor_ms`` and ``floor_threads`` (the count that read fastest) for
    ``model``'s weights; ``torch_threads``: the threads the engine decodes on now, reported beside them."""
    params = {p.data_ptr(): p for p in model.parameters()}.values()  # tied weights: once
    weight_bytes = sum(p.numel() * p.element_size() for p in params)
    big = max(params, key=lambda p: p.numel()).detach().flatten()
    # Its bytes summed as float32 (a bf16 sum converts every element and runs below memory speed on a CPU).
    words = big.view(torch.float32) if big.numel() * big.element_size() % 4 == 0 else big

    def read_speed(threads: int) -> float:  # bytes/s; on a thread of its own, whose OpenMP pool ends with it
        pin_threads(threads)
        with torch.inference_mode():
            words.sum()  # warm-up
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                float(words.sum())
                times.append(time.perf_counter() - t0)
        return big.numel() * big.element_size() / statistics.median(times)

    best = {threads: on_own_thread(read_speed, threads) for threads in sorted({1, usable_cores()})}
    threads, bandwidth = max(best.items(), key=lambda kv: kv[1])
    return {"weight_bytes": weight_bytes, "read_gb_per_s": bandwidth / 1e9, "floor_ms": weight_bytes / bandwidth * 1e3,
            "floor_threads": threads, "torch_threads": torch_threads}
