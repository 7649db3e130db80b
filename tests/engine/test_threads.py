"""The engine's torch thread rule (issue 22): every usable core; -1 tunes between 1 and all by the decode passes'
own times; an explicit count wins and is never tuned; other threads run torch on one core, without a pool."""

from __future__ import annotations

import os
import sys
import threading

import pytest
import torch

from inferscale.engine import threads
from inferscale.engine.threads import (configure_threads, cpu_quota_cores, default_threads, on_own_thread, pin_threads,
                                       tuned_choices, usable_cores)
from inferscale.engine.threadtuner import MAX_EVERY, PROBE_EVERY, RECENT, ThreadTuner
from inferscale.errors import ConfigError
from os_threads import os_threads


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    configure_threads(before)


def _cgroups(tmp_path, membership: str, files: dict[str, str]):
    for name, text in files.items():
        (tmp_path / "fs" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "fs" / name).write_text(text)
    (tmp_path / "cgroup").write_text(membership)
    return tmp_path / "fs", tmp_path / "cgroup"


def test_a_cgroup_cpu_quota_caps_the_cores(tmp_path, monkeypatch):
    # cgroup v2 in the container's own namespace: 1.5 cores -> 2
    assert cpu_quota_cores(*_cgroups(tmp_path / "a", "0::/\n", {"cpu.max": "150000 100000\n"})) == 2
    # the host's view: the pod's limit sits on an ancestor of the container's cgroup; the tightest counts
    assert cpu_quota_cores(*_cgroups(tmp_path / "b", "0::/kubepods/pod1/ctr\n", {
        "kubepods/pod1/ctr/cpu.max": "max 100000", "kubepods/pod1/cpu.max": "300000 100000",
        "kubepods/cpu.max": "800000 100000", "cpu.max": "max 100000"})) == 3
    # cgroup v1, cpu and cpuacct mounted together
    assert cpu_quota_cores(*_cgroups(tmp_path / "c", "9:name=systemd:/\n4:cpu,cpuacct:/\n", {
        "cpu,cpuacct/cpu.cfs_quota_us": "200000", "cpu,cpuacct/cpu.cfs_period_us": "100000"})) == 2
    # no quota (v1's -1, v2's "max"), or nothing readable: none
    assert cpu_quota_cores(*_cgroups(tmp_path / "d", "1:cpu:/\n", {
        "cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"})) is None
    assert cpu_quota_cores(*_cgroups(tmp_path / "e", "0::/\n", {"cpu.max": "max 100000"})) is None
    assert cpu_quota_cores(tmp_path / "none", tmp_path / "none" / "cgroup") is None
    # the thread rule takes the smaller of the affinity mask and the quota
    monkeypatch.setattr(threads, "cpu_quota_cores", lambda: 1)
    assert usable_cores() == 1 == default_threads()
    monkeypatch.setattr(threads, "cpu_quota_cores", lambda: 10_000)
    assert usable_cores() == len(os.sched_getaffinity(0))


def test_the_default_is_every_core_untuned(restore_threads):
    assert configure_threads(0) == torch.get_num_threads() == usable_cores() == default_threads()
    assert tuned_choices() == ()


def test_minus_one_starts_with_every_core_and_tunes_between_one_and_all(restore_threads):
    assert configure_threads(-1) == torch.get_num_threads() == usable_cores()
    assert tuned_choices() == ((1, usable_cores()) if usable_cores() > 1 else ())


def test_an_explicit_count_is_set_and_not_tuned(restore_threads):
    assert configure_threads(1) == torch.get_num_threads() == 1
    assert tuned_choices() == ()
    assert not ThreadTuner(tuned_choices(), torch.set_num_threads).active


def test_a_negative_count_is_a_config_error():
    with pytest.raises(ConfigError, match="threads=-2"):
        configure_threads(-2)


def run(tuner: ThreadTuner, seconds: dict[int, float], passes: int, batch: int = 4) -> list[int]:
    """Drive ``tuner`` for ``passes`` decode passes whose time depends only on the thread count set."""
    state = {"n": tuner.current}
    tuner._set = lambda n: state.__setitem__("n", n)
    used = []
    for _ in range(passes):
        tuner.before_decode(batch)
        used.append(state["n"])
        tuner.after_decode(batch, seconds[state["n"]])
    return used


def test_the_tuner_switches_to_the_faster_count_and_stays():
    tuner = ThreadTuner((1, 2), lambda n: None)
    used = run(tuner, {1: 0.1, 2: 0.5}, 200)  # two threads lose (a loaded machine)
    assert tuner.current == 1
    assert used[:PROBE_EVERY] == [2] * PROBE_EVERY and used[PROBE_EVERY] == 1
    assert used[-100:].count(2) <= 1  # probing the loser again is rare


def test_the_tuner_keeps_the_current_count_when_the_other_loses_and_probes_less_often():
    tuner = ThreadTuner((1, 2), lambda n: None)
    used = run(tuner, {1: 0.2, 2: 0.1}, 3000)  # two threads win (a quiet machine)
    assert tuner.current == 2 and tuner.every == MAX_EVERY
    assert used.count(1) <= 12  # a handful of probes in 3000 passes (after 16, 32, 64 ... then every 512)


def test_a_probe_waits_for_passes_at_the_same_batch_size():
    tuner = ThreadTuner((1, 2), lambda n: None)
    state = {"n": 2}
    tuner._set = lambda n: state.__setitem__("n", n)
    for i in range(PROBE_EVERY + RECENT):
        tuner.before_decode(i)  # the batch changes every pass: no fair comparison, no probe
        assert state["n"] == 2
        tuner.after_decode(i, 0.1)


# ---- one OpenMP pool: only the engine thread computes on every core --------------------------------------------
def _in_thread_alive(work, pin: bool) -> tuple[int, int]:
    """Run ``work`` on a new thread (pinned to one core or not) and, while that thread still lives, count this
    process's OS threads; (threads it added, its torch thread count)."""
    done, release, seen = threading.Event(), threading.Event(), {}

    def run():
        if pin:
            pin_threads(1)
        work()
        seen["threads"] = torch.get_num_threads()
        done.set()
        release.wait(30)

    before = os_threads()
    thread = threading.Thread(target=run)
    thread.start()
    done.wait(30)
    added = os_threads() - before
    release.set()
    thread.join()
    return added, seen["threads"]


def _parallel_kernels():
    x = torch.ones(1 << 22)
    x.add_(1)  # an aten kernel split over threads
    (torch.ones(512, 512) @ torch.ones(512, 512)).sum()  # MKL's own threads


@pytest.mark.skipif(not sys.platform.startswith("linux") or usable_cores() < 2, reason="needs /proc and 2 cores")
def test_a_pinned_thread_runs_torch_on_its_own_core_and_keeps_no_pool():
    """libgomp keeps a pool of workers for every thread that ran a parallel kernel; past one worker per core none
    of them spins between kernels (the server's decode step 19 -> 28 ms on 2 cores). A pinned thread adds only
    itself; the same kernels on an unpinned thread add its pool."""
    pinned, count = _in_thread_alive(_parallel_kernels, pin=True)
    assert (pinned, count) == (1, 1)
    unpinned, _ = _in_thread_alive(_parallel_kernels, pin=False)
    assert unpinned > 1


def test_pinning_a_thread_leaves_the_others_and_the_default_as_they_are():
    before = torch.get_num_threads()
    _, count = _in_thread_alive(lambda: None, pin=True)
    assert count == 1 and torch.get_num_threads() == before
    _, fresh = _in_thread_alive(lambda: None, pin=False)  # a new thread still starts from torch's default
    assert fresh == before


@pytest.mark.skipif(not sys.platform.startswith("linux") or usable_cores() < 2, reason="needs /proc and 2 cores")
def test_work_on_its_own_thread_returns_its_result_and_leaves_no_pool():
    before = os_threads()
    assert on_own_thread(lambda x: (_parallel_kernels(), x * 2)[1], 21) == 42
    assert os_threads() == before  # the thread and its OpenMP pool are gone
    with pytest.raises(ZeroDivisionError):
        on_own_thread(lambda: 1 / 0)
