"""`inferscale bench ttft` and `bench locomo` run end to end on a tiny model and write the documented JSON."""

import json
import math
import os

import pytest

import tiny_models as tm
from inferscale.bench.locomo import f1_score, normalize_answer, parse_modes
from inferscale.cli import main


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-gemma3")
    tm.model("gemma3", sliding_window=64).save_pretrained(d)
    tm.tokenizer().save_pretrained(d)
    return d


def test_bench_ttft_json(model_dir, tmp_path):
    out = tmp_path / "ttft.json"
    assert main(["bench", "ttft", "--model", str(model_dir), "--k", "1,3", "--repeats", "2", "--json", str(out),
                 "--plot", str(tmp_path / "ttft.png")]) == 0
    result = json.loads(out.read_text())
    assert {"model", "device", "threads", "rows"} <= set(result)
    assert [r["k"] for r in result["rows"]] == [1, 3]
    for row in result["rows"]:
        assert {"k", "memory_tokens", "ttft_text_ms", "ttft_kv_ms", "ttft_kv_cold_ms", "ttft_floor_ms"} <= set(row)
        assert row["memory_tokens"] > 0 and all(row[f] > 0 for f in row if f.startswith("ttft_"))
    assert (tmp_path / "ttft.png").stat().st_size > 1000


def _locomo(path):
    facts = [["caroline went to paris in may 2023", "D1:1"], ["melanie painted the beach", "D1:2"],
             ["they went camping with the kids", "D1:3"]]
    sample = {
        "sample_id": "conv-x",
        "conversation": {"session_1_date_time": "1:56 pm on 8 May, 2023"},
        "observation": {"session_1_observation": {"Caroline": facts}},
        "qa": [{"question": "where did caroline go?", "answer": "paris", "evidence": ["D1:1"], "category": 4},
               {"question": "what did melanie paint?", "answer": "the beach", "evidence": ["D1:2"], "category": 1},
               {"question": "adversarial", "adversarial_answer": "x", "evidence": [], "category": 5}],
    }
    path.write_text(json.dumps([sample]))
    return path


def test_bench_locomo_json(model_dir, tmp_path):
    out = tmp_path / "locomo.json"
    data = _locomo(tmp_path / "locomo.json.in")
    assert main(["bench", "locomo", "--data", str(data), "--model", str(model_dir), "--k", "2",
                 "--modes", "text,kv,kv-recompute@0,kv-recompute@1", "--max-tokens", "3", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["summary"]) == {"text", "kv", "kv-recompute@0", "kv-recompute@1"}
    for s in result["summary"].values():
        assert {"f1", "agree_first_token", "agree_answer", "ttft_p50_ms"} <= set(s)
    rows = result["rows"]
    assert len(rows) == 2 * 4 and {r["category"] for r in rows} == {1, 4}  # category 5 excluded
    # r=1 recomputes every memory token: the same answer as text, question by question
    by = {(r["question"], r["mode"]): r for r in rows}
    for q in ("where did caroline go?", "what did melanie paint?"):
        assert by[(q, "kv-recompute@1")]["agree_answer"] and by[(q, "kv-recompute@0")]["answer"] == by[(q, "kv")]["answer"]


def test_bench_locomo_per_kv_dtype(model_dir, tmp_path):
    """--kv-dtype runs each KV mode once per format against the same text reference; KL is reported per mode."""
    out = tmp_path / "locomo.json"
    data = _locomo(tmp_path / "locomo.json.in")
    assert main(["bench", "locomo", "--data", str(data), "--model", str(model_dir), "--k", "2", "--modes", "text,kv",
                 "--kv-dtype", "bf16,int8,int4", "--max-tokens", "2", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    summary = result["summary"]
    assert list(summary) == ["text", "kv", "kv/int8", "kv/int4"] and result["kv_dtypes"] == ["bf16", "int8", "int4"]
    assert [summary[m]["kv_dtype"] for m in summary] == ["bf16", "bf16", "int8", "int4"]
    assert summary["text"]["kl_first_token"] == 0 and summary["text"]["agree_first_token"] == 1
    for m in ("kv", "kv/int8", "kv/int4"):
        assert summary[m]["kl_first_token"] is not None and summary[m]["kl_first_token"] >= 0
    assert "kl_vs_bf16" not in summary["kv"]
    for m in ("kv/int8", "kv/int4"):
        assert summary[m]["kl_vs_bf16"] >= 0 and 0 <= summary[m]["agree_first_token_bf16"] <= 1
    assert summary["kv/int8"]["kl_vs_bf16"] < summary["kv/int4"]["kl_vs_bf16"]
    rows = {(r["question"], r["mode"]): r for r in result["rows"]}
    q = "where did caroline go?"
    # int4 blocks differ from bf16 ones, so its first-token distribution does too (the format really is used)
    assert rows[(q, "kv/int4")]["kl_first_token"] != rows[(q, "kv")]["kl_first_token"]
    assert main(["bench", "locomo", "--data", str(data), "--model", str(model_dir), "--kv-dtype", "int3"]) == 2


def test_locomo_f1_normalisation():
    assert normalize_answer("The Beach, and a Sunset!") == "beach sunset"
    assert f1_score("painted sunsets", "Sunsets") == pytest.approx(2 / 3)
    assert f1_score("", "x") == 0.0
    assert [m[0] for m in parse_modes("kv,kv-recompute@0.05", 0.15)] == ["text", "kv", "kv-recompute@0.05"]


def test_bench_load_json(model_dir, tmp_path, capsys):
    """The load benchmark's smallest run: real server, official client, kv and text side by side, the flood."""
    out = tmp_path / "load.json"
    assert main(["bench", "load", "--model", str(model_dir), "--n", "1,2", "--tokens", "3", "-k", "2", "--flood",
                 "--flood-requests", "2", "--users", "2", "--hold", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["users"] == 2
    assert [(r["n"], r["mode"]) for r in result["rows"]] == [(1, "kv"), (1, "text"), (2, "kv"), (2, "text")]
    for row in result["rows"]:
        assert row["tokens_per_s"] > 0 and row["ttft_p50_ms"] > 0 and row["tpot_p50_ms"] > 0
        assert (row["arrival_ttft_ms"] is None) == (row["n"] == 1)
        assert 0 < row["client_cores"] <= os.cpu_count()  # the SDK parsing chunks: a share of the cores
        # the engine's own N-row decode steps inside the server, from its step tally (one stream: every token after
        # the first is one)
        assert (row["engine_step_ms"] is None) == (row["engine_steps"] == 0)
        if row["n"] == 1:
            assert row["engine_steps"] >= 2 and row["engine_step_ms"] > 0
    assert result["flood"]["b_flood_ttft_ms"] > 0 and result["flood"]["b_idle_ttft_ms"] > 0
    # the refusals that did not come at admission, apart (two requests: none refused), and the host's steal beside
    assert result["flood"]["a_refused_late_ms"] == [] and result["summary"]["flood_refused_late"]["max"] == 0
    steal = result["flood"]["host_steal_s"]
    assert steal is None or steal >= 0
    # Issue 22's bar, printed and written: the floor beside the step, N/1 ratios, the flood's ratio.
    assert result["floor"]["floor_ms"] > 0 and result["floor"]["weight_bytes"] > 0
    summary = result["summary"]
    for key in ("floor_ms", "kv_step_over_floor", "kv_decode_tokens_per_s_2_over_1", "flood_ratio"):
        assert summary[key]["min"] <= summary[key]["median"] <= summary[key]["max"]
    printed = capsys.readouterr().out
    assert f"bar: kv single-stream step / floor = {summary['kv_step_over_floor']['median']:.2f}x" in printed
    assert ("bar: kv aggregate decode tokens/s over the whole span, 2 streams / 1 stream = "
            f"{summary['kv_decode_tokens_per_s_2_over_1']['median']:.2f}x") in printed
    assert "bar: kv aggregate decode tokens/s while all decode, 2 streams / 1 stream = " in printed
    engine = summary.get("kv_engine_tokens_per_s_2_over_1")
    if engine is not None:
        assert (f"beside it: kv the engine's own decode steps inside the server (its step tally), 2 rows / 1 row = "
                f"{engine['median']:.2f}x") in printed
    assert result["floor"]["floor_threads"] >= 1 and result["floor"]["torch_threads"] >= 1
    # the hold: tenant A's kv answers, one for each of the flood server's slots, 4x --tokens long, none refused
    hold = result["hold"]
    assert (hold["flood_requests"], hold["flood_mode"], hold["flood_tokens"], hold["a_refused"]) == (64, "kv", 12, 0)
    assert hold["b_flood_ttft_ms"] > 0 and summary["hold_ratio"]["median"] == hold["ratio"]
    assert "hold: 64 kv requests (k=2) of 12 tokens of tenant A, one for each slot, none refused; tenant B" in printed


def test_bench_load_streams_ask_as_their_users():
    """``bench load --users U``: stream i asks as user i mod U, each user its own question (the memories, loaded per
    user, are a set of their own); one user is one user's concurrent questions, the same question N times."""
    from inferscale.bench.load import stream_asks
    from inferscale.bench.loadclients import QUESTION

    assert {stream_asks(i, 1) for i in range(16)} == {("maya", QUESTION)}
    asks = [stream_asks(i, 3) for i in range(6)]
    assert [user for user, _ in asks] == ["maya", "user-1", "user-2"] * 2
    assert len({question for _, question in asks}) == 3


def test_bench_step_json(model_dir, tmp_path, capsys):
    """The engine's step alone: each N's steady steps, N rows against one in each repeat, the floor beside them, and
    (--profile) the last repeat's operators per step."""
    out = tmp_path / "step.json"
    assert main(["bench", "step", "--model", str(model_dir), "--n", "2,1", "--tokens", "6", "-k", "2", "--repeats",
                 "2", "--profile", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert len(result["repeats"]) == 2
    for i, rep in enumerate(result["repeats"]):
        assert rep["floor"]["floor_ms"] > 0 and rep["floor"]["weight_bytes"] > 0
        one, two = rep["rows"]
        assert (one["n"], two["n"]) == (1, 2)
        for row in rep["rows"]:
            assert row["steady_steps"] >= 1 and 0 < row["step_min_ms"] <= row["step_ms"] <= row["step_max_ms"]
            assert row["tokens_per_s"] == pytest.approx(row["n"] / row["step_ms"] * 1e3)
            profiled = "operators" in row
            assert profiled == (i == 1)  # the last repeat only
            if profiled:
                assert row["operators"] and all(op["ms_per_step"] >= 0 and op["calls_per_step"] > 0
                                                for op in row["operators"])
    ratios = [2 * r["rows"][0]["step_ms"] / r["rows"][1]["step_ms"] for r in result["repeats"]]
    spread = result["summary"]["tokens_per_s_2_over_1"]
    assert (spread["min"], spread["max"]) == pytest.approx((min(ratios), max(ratios)))
    assert result["summary"]["step_over_floor"]["median"] > 0
    assert f"engine alone: decode tokens/s, 2 rows / 1 row = {spread['median']:.2f}x" in capsys.readouterr().out


@pytest.mark.parametrize("bad", [["--n", "0"], ["--tokens", "2"], ["--repeats", "0"]])
def test_bench_step_refuses_what_it_cannot_measure(model_dir, bad, capsys):
    """A clear error naming the flag, before any model is loaded."""
    assert main(["bench", "step", "--model", str(model_dir), *bad]) != 0
    assert f"inferscale: error: {bad[0]}" in capsys.readouterr().err


def test_bench_load_sends_the_extra_body(model_dir, tmp_path, capsys):
    """``--extra-body`` reaches every load stream's request (a temperature the server refuses fails the run, naming
    it), and is written and printed with the results; what is not a JSON object is refused before any server starts."""
    out = tmp_path / "load.json"
    base = ["bench", "load", "--model", str(model_dir), "--n", "1", "--modes", "kv", "--tokens", "3", "-k", "2"]
    assert main([*base, "--extra-body", '{"temperature": 0.7, "top_p": 0.9, "min_tokens": 3}', "--json", str(out)]) == 0
    assert json.loads(out.read_text())["extra_body"] == {"temperature": 0.7, "top_p": 0.9, "min_tokens": 3}
    assert 'tokens per request with {"temperature": 0.7, "top_p": 0.9, "min_tokens": 3}' in capsys.readouterr().out
    assert main([*base, "--extra-body", '{"temperature": 5}']) == 2
    assert "temperature" in capsys.readouterr().err
    for bad in ("{temperature: 1}", "[1]"):
        assert main([*base, "--extra-body", bad]) == 2
        assert "--extra-body" in capsys.readouterr().err


def test_the_steady_rate_counts_only_while_every_stream_decodes():
    """Two streams: one decodes from t=0 at 10 tokens/s, the other starts at t=1 (its prompt's prefill in between)
    at 10 tokens/s too. While both decode the rate is 20/s; over the whole span it reads lower."""
    from inferscale.bench.loadclients import Stream, _decode_rate, _steady_rate

    def stream(start: float, n: int) -> Stream:
        times = tuple(start + i / 10 for i in range(n))
        return Stream(0.0, 0.1, n, times)

    both = [stream(0.0, 31), stream(1.0, 31)]  # 0..3 s and 1..4 s: both decode from 1 to 3 s
    assert _steady_rate(both) == pytest.approx(20.0)
    assert _decode_rate(both) == pytest.approx(60 / 4.0)
    assert _steady_rate([stream(0.0, 11)]) == pytest.approx(10.0)  # one stream: 1 / its time per token
    assert math.isnan(_steady_rate([stream(0.0, 11), stream(2.0, 11)]))  # never both at once


def test_bench_fleet_json(model_dir, tmp_path):
    """The cold path's bench: a real peer process over NIXL, rows with the documented fields."""
    out = tmp_path / "fleet.json"
    assert main(["bench", "fleet", "--model", str(model_dir), "--k", "1,3", "--repeats", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["k"] for r in result["rows"]] == [1, 3]
    for row in result["rows"]:
        assert {"k", "ttft_peer_ms", "ttft_dram_ms", "ttft_text_ms", "bytes_pulled"} <= set(row)
        assert all(row[f] > 0 for f in ("ttft_peer_ms", "ttft_dram_ms", "ttft_text_ms", "bytes_pulled"))
    assert result["rows"][1]["bytes_pulled"] > result["rows"][0]["bytes_pulled"]  # exactly k blocks moved
    assert {"peer_over_dram", "peer_over_text"} <= set(result["bar"])


def test_the_bench_memories_are_stored_with_their_dates():
    """`bench load`, `bench isolation` and `scripts/aiperf.sh` store the synthetic set through the API as it is: its
    20-35 tokens a memory count the date (without it, 395 tokens at k=20 instead of 586), and a question about when
    something happened has no answer without one."""
    from inferscale.bench.synthetic import put_body, synthetic_memories
    from inferscale.server.schemas import PutMemories

    items = synthetic_memories(5, tm.tokenizer())
    stored = PutMemories.model_validate(put_body(items)).items
    assert [(m.id, m.text, m.timestamp) for m in stored] == [(it.id, it.text, it.timestamp) for it in items]
    assert all(m.timestamp for m in stored)


def test_aiperf_inputs_synthetic_and_bench(model_dir, tmp_path):
    """`scripts/aiperf.sh`'s inputs: k dated synthetic memories; no questions file content (aiperf's own prompts)
    unless `--prompts bench`, which sends `bench load`'s question."""
    from inferscale.bench import aiperfinputs
    from inferscale.bench.loadclients import QUESTION

    assert aiperfinputs.main(["--tokenizer", str(model_dir), "--k", "3", str(tmp_path)]) == 0
    items = json.loads((tmp_path / "memories.json").read_text())["items"]
    assert len(items) == 3 and all(it["timestamp"] for it in items)
    assert (tmp_path / "questions.jsonl").read_text() == ""
    assert aiperfinputs.main(["--tokenizer", str(model_dir), "--k", "3", "--prompts", "bench", str(tmp_path)]) == 0
    questions = [json.loads(line) for line in (tmp_path / "questions.jsonl").read_text().splitlines()]
    assert questions == [{"text": QUESTION}]


def test_aiperf_inputs_locomo(model_dir, tmp_path):
    """With a LoCoMo file: every observation of the first conversation, dated by its session, and its questions
    (the adversarial category left out, as `bench locomo` leaves it)."""
    from inferscale.bench import aiperfinputs

    data = _locomo(tmp_path / "locomo.json")
    assert aiperfinputs.main(["--tokenizer", str(model_dir), "--locomo", str(data), str(tmp_path)]) == 0
    items = json.loads((tmp_path / "memories.json").read_text())["items"]
    assert [(it["text"], it["timestamp"]) for it in items] == [
        ("caroline went to paris in may 2023", "8 May 2023"), ("melanie painted the beach", "8 May 2023"),
        ("they went camping with the kids", "8 May 2023")]
    questions = [json.loads(line)["text"] for line in (tmp_path / "questions.jsonl").read_text().splitlines()]
    assert questions == ["where did caroline go?", "what did melanie paint?"]


@pytest.mark.parametrize("words", ["-1", "4001"])
def test_bench_load_refuses_a_flood_document_it_cannot_send(model_dir, words, capsys):
    assert main(["bench", "load", "--model", str(model_dir), "--flood", "--flood-words", words]) != 0
    assert "inferscale: error: --flood-words" in capsys.readouterr().err


def test_a_flood_of_long_prompts_asks_the_same_question_after_a_document():
    from inferscale.bench.loadclients import QUESTION, long_question

    assert long_question(0) == QUESTION
    long_ = long_question(2000)
    assert long_.endswith("\n\n" + QUESTION) and len(long_.split()) == 2000 + len(QUESTION.split())
