"""scripts/gpu-check.sh cannot run without a GPU; what can be checked on CPU is checked here."""

import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu-check.sh"


def test_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_dry_run_lists_every_step_within_eight_minutes():
    out = subprocess.run(["bash", str(SCRIPT), "--dry-run"], check=True, capture_output=True, text=True).stdout
    steps = [line.split() for line in out.splitlines()[1:]]
    assert [s[0] for s in steps] == ["install", "kernels", "engine", "ttft", "trtllm"]
    assert sum(int(s[2].rstrip("s")) for s in steps) < 8 * 60
    assert "TRITON_INTERPRET=0" in out  # kernels compiled, not interpreted
    assert "--random-weights llama3-8b" in out and "--k 5,20,50" in out


def test_without_a_gpu_it_says_so_and_fails(tmp_path):
    r = subprocess.run(["bash", str(SCRIPT), "--out", str(tmp_path)], capture_output=True, text=True,
                       env={"PATH": "/usr/bin:/bin"})
    assert r.returncode == 2 and "CUDA machine" in r.stderr
