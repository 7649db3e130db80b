"""Kernel builds (``kernels/cppext.py``) where a serving pod runs them: a build made when the image was made loads
without ninja, a compiler or a writable cache; a cache that cannot be written sends a new build to the temporary
directory, which the next start loads."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from inferscale.kernels import cppext, rms_norm

ROOT = Path(__file__).resolve().parents[2]

# In a process of its own: the operators it loads stay out of this one. Nothing there can compile (no ninja, no
# compiler on PATH, torch's builder refuses), so the kernel comes from the cache or not at all.
NO_COMPILER = """
import sys, torch
from torch.utils import cpp_extension
from inferscale.kernels import cppext, rms_norm

def refuse(*args, **kwargs):
    raise RuntimeError("no compiler here")

cpp_extension.load = refuse
assert cppext.build(rms_norm.SOURCE, rms_norm.FLAGS), "the cached build did not load"
x = torch.randn(3, 640).to(torch.bfloat16)
w = torch.ones(640)
assert torch.equal(torch.ops.inferscale_norm.rms_norm(x, w, 1e-6), rms_norm.reference(x, w, 1e-6))
print("loaded", cppext.build_dir(rms_norm.SOURCE, rms_norm.FLAGS))
"""
BUILD = "from inferscale.kernels import cppext, rms_norm; assert cppext.build(rms_norm.SOURCE, rms_norm.FLAGS)"


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONSAFEPATH": "1", **env}, cwd=ROOT)


def test_a_cached_build_loads_without_ninja_or_a_compiler():
    if not cppext.build(rms_norm.SOURCE, rms_norm.FLAGS):
        pytest.skip("rms_norm cannot be built on this machine")
    assert cppext.library(rms_norm.SOURCE, cppext.build_dir(rms_norm.SOURCE, rms_norm.FLAGS)).is_file()
    run = _python(NO_COMPILER, PATH=os.path.dirname(sys.executable))
    assert run.returncode == 0, run.stderr[-2000:]
    assert "loaded" in run.stdout


def test_a_pods_own_build_under_the_temporary_directory_is_loaded_the_next_time(tmp_path):
    if not cppext.build(rms_norm.SOURCE, rms_norm.FLAGS):
        pytest.skip("rms_norm cannot be built on this machine")
    (tmp_path / "a-file").write_text("")
    env = {"INFERSCALE_CACHE_DIR": str(tmp_path / "a-file" / "cache"), "TMPDIR": str(tmp_path)}  # no cache to write
    first = _python(BUILD, **env)  # built under $TMPDIR
    assert first.returncode == 0, first.stderr[-2000:]
    assert list((tmp_path / "inferscale-torch-extensions").glob("rms_norm-*/inferscale_rms_norm.so"))
    again = _python(NO_COMPILER, PATH=os.path.dirname(sys.executable), **env)  # a restart: loaded, not compiled
    assert again.returncode == 0, again.stderr[-2000:]


def test_a_cache_that_cannot_be_written_builds_under_the_temporary_directory(monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("INFERSCALE_CACHE_DIR", str(blocker / "cache"))  # under a file: no directory can be made
    target = cppext.writable(cppext.build_dir(rms_norm.SOURCE, rms_norm.FLAGS))
    assert target.is_dir() and os.access(target, os.W_OK)
    assert target.parent == Path(tempfile.gettempdir()) / "inferscale-torch-extensions"
    assert target.name == cppext.build_dir(rms_norm.SOURCE, rms_norm.FLAGS).name  # the same key: source and flags
    monkeypatch.setenv("INFERSCALE_CACHE_DIR", str(tmp_path / "cache"))  # control: a cache that can be written
    assert cppext.writable(cppext.build_dir(rms_norm.SOURCE, rms_norm.FLAGS)).is_relative_to(tmp_path / "cache")
