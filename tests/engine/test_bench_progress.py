"""The long benches' progress bar: on stderr when it is a terminal, silent otherwise (pipes, CI logs)."""

from __future__ import annotations

import io

from inferscale.bench.progress import progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_bar_draws_on_a_terminal():
    term = _Terminal()
    bar = progress(total=4, desc="bench ttft", unit="prefill", file=term)
    for _ in range(4):
        bar.update()
    bar.refresh()  # tqdm redraws at most every 0.1 s
    bar.close()
    out = term.getvalue()
    assert "bench ttft" in out and "4/4" in out and "prefill" in out


def test_bar_is_silent_when_not_a_terminal():
    pipe = io.StringIO()
    bar = progress(total=3, desc="bench locomo", file=pipe)
    bar.total += 2  # locomo grows the total per conversation
    bar.update(5)
    bar.close()
    assert pipe.getvalue() == ""


def test_bar_defaults_to_stderr(monkeypatch):
    term = _Terminal()
    monkeypatch.setattr("sys.stderr", term)
    with progress(total=1, desc="on stderr") as bar:
        bar.update()
    assert "on stderr" in term.getvalue()
