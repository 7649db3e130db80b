"""The LM head's int8 screen for greedy decoding (``models/greedyhead.py``, ``kernels/greedy_screen.h`` on AMX in
``amx_linear.cpp``, AVX512-VNNI in ``bf16_linear.cpp`` or AVX2 in ``avx2_linear.cpp``, whichever ``decode_linear``
picks here; issue 22):
the token is the full bf16 head's argmax bit for bit (ties to the first maximum included), the int8 product is
exact, the screen stands aside where it cannot apply, and a greedy decode says the same tokens with and without
it. Skipped where neither kernel's screen runs (the full head is used there)."""

from __future__ import annotations

import pytest
import torch

import tiny_models as tm
from inferscale.engine.loop import GenRequest
from inferscale.engine.sampling import Sampling
from inferscale.kernels import amx_linear, decode_linear
from inferscale.models import greedyhead
from inferscale.models.greedyhead import GreedyHead, install_greedy_head
from inferscale.models.weightmajor import KERNEL, WeightMajorLinear


@pytest.fixture(scope="module")
def ops():
    if decode_linear.screen_ops() is None:
        pytest.skip("no decode kernel with a screen here: greedy steps read the whole head")
    return decode_linear.screen_ops()


@pytest.fixture(scope="module")
def max_rows(ops) -> int:
    return decode_linear.screen_rows()  # 4 on AMX, 16 on the VNNI kernel (its wide screen from 5 rows) and on AVX2


def _head(weight: torch.Tensor) -> WeightMajorLinear:
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight = torch.nn.Parameter(weight, requires_grad=False)
    return WeightMajorLinear(linear, KERNEL, transposed_out=True)


def _full_argmax(weight: torch.Tensor, x: torch.Tensor) -> list[int]:
    return decode_linear.load()(weight, x).max(dim=-1).indices.tolist()


def test_the_int8_product_is_exact(ops):
    if amx_linear.screen_ops() is None:
        pytest.skip("AMX's int8 product (the AVX512-VNNI screen's sums are checked through its candidates)")
    ops = torch.ops.inferscale_cpu
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(-127, 128, (1000, 640), generator=gen, dtype=torch.int8)
    for rows in (1, 2, 15, 16, 17, 33):
        x = torch.randint(-127, 128, (rows, 640), generator=gen, dtype=torch.int8)
        assert torch.equal(ops.amx_linear_int8(q, x), x.int() @ q.int().T), rows


def test_the_screened_token_is_the_full_heads_argmax(ops, max_rows):
    """Random heads and hidden rows of every scale, 1 to max_rows rows a call (the kernel's screen at every row
    count it may be given): the same token as the bf16 head."""
    gen = torch.Generator().manual_seed(1)
    weight = (torch.randn(20000, 640, generator=gen) * 0.05).to(torch.bfloat16)
    greedy = GreedyHead(weight)
    with torch.inference_mode():
        for scale in (0.01, 1.0, 30.0, 1000.0):
            for rows in range(1, max_rows + 1):
                x = (torch.randn(rows, 640, generator=gen) * scale).to(torch.bfloat16)
                x[:, 7] *= 50  # an outlier channel, as Gemma's hidden states have
                assert greedy.argmax(x) == _full_argmax(weight, x), (scale, rows)


def test_more_rows_than_one_call_takes_are_screened_in_groups_where_that_pays(ops, max_rows):
    """Past one call's rows (a 17-48-row decode step) the VNNI and AVX2 kernels screen in calls of max_rows and the
    rest, each row's token still the full head's; AMX's screen stands aside there (its head is cheaper)."""
    gen = torch.Generator().manual_seed(7)
    weight = (torch.randn(20000, 640, generator=gen) * 0.05).to(torch.bfloat16)
    greedy = GreedyHead(weight)
    assert greedy.grouped == (amx_linear.load() is None)
    greedy.grouped = True
    with torch.inference_mode():
        for rows in (max_rows + 1, max_rows + 4, 2 * max_rows, 3 * max_rows + 5):
            x = torch.randn(rows, 640, generator=gen).to(torch.bfloat16)
            x[:, 7] *= 50
            x[rows // 2] = x[0]  # the same row in two calls: the same token
            assert greedy.argmax(x) == _full_argmax(weight, x), rows


def test_every_row_count_the_screen_accepts_keeps_each_rows_argmax(ops, max_rows):
    """The kernel's op either refuses a row count or screens every row it was given: no row comes back without
    candidates (the VNNI screen once accepted 8 rows and screened only the first 4)."""
    gen = torch.Generator().manual_seed(6)
    weight = (torch.randn(3000, 640, generator=gen) * 0.05).to(torch.bfloat16)
    packed = GreedyHead(weight).packed
    accepted = []
    for rows in range(1, max_rows + 3):
        x = torch.randn(rows, 640, generator=gen).to(torch.bfloat16)
        try:
            candidates = ops[1](*packed, x)
        except RuntimeError as e:
            assert "rows of x" in str(e), e
            continue
        accepted.append(rows)
        for row, best in enumerate(_full_argmax(weight, x)):
            assert best in candidates[candidates[:, 0] == row, 1].tolist(), (rows, row)
    assert accepted == list(range(1, max_rows + 1))


def test_the_argmax_in_the_last_partial_vector_is_found(ops, max_rows):
    """A vocabulary that ends mid-vector (4,099 rows: 3 past the last full 16): a winner there is a candidate and
    the token, and no row past the vocabulary is ever one."""
    gen = torch.Generator().manual_seed(5)
    weight = (torch.randn(4099, 640, generator=gen) * 0.05).to(torch.bfloat16)
    x = torch.randn(2, 640, generator=gen).to(torch.bfloat16)
    for row, winner in ((0, 4098), (1, 4096)):
        weight[winner] = (x[row].float() * 0.2).to(torch.bfloat16)  # far above every other logit of that row
    greedy = GreedyHead(weight)
    with torch.inference_mode():
        candidates = ops[1](*greedy.packed, x)
        assert int(candidates[:, 1].max()) < 4099
        assert greedy.argmax(x) == [4098, 4096] == _full_argmax(weight, x)


@pytest.mark.parametrize("rows", [1, 9])  # the two-row screen's bound and the wide screen's
def test_ties_go_to_the_first_maximum(ops, max_rows, rows):
    """Rows equal to the winner (the same logit to the bit) placed before and after it: argmax's first maximum."""
    if rows > max_rows:
        pytest.skip(f"this kernel's screen takes {max_rows} rows")
    gen = torch.Generator().manual_seed(2)
    weight = (torch.randn(5000, 640, generator=gen) * 0.05).to(torch.bfloat16)
    x = torch.randn(rows, 640, generator=gen).to(torch.bfloat16)
    best = _full_argmax(weight, x)[0]
    weight[4000] = weight[best]
    weight[17] = weight[best]
    weight[18] = -weight[best]
    full = _full_argmax(weight, x)
    assert full[0] == 17
    with torch.inference_mode():
        assert GreedyHead(weight).argmax(x) == full


@pytest.mark.parametrize("rows", [1, 9])
def test_near_ties_in_bf16_keep_the_first_maximum(ops, max_rows, rows):
    """Rows whose logits differ from the winner's by less than a bf16 step (so the bf16 logits tie): the screen
    keeps them all and the earliest wins, as in the full head."""
    if rows > max_rows:
        pytest.skip(f"this kernel's screen takes {max_rows} rows")
    gen = torch.Generator().manual_seed(3)
    weight = (torch.randn(3000, 640, generator=gen) * 0.02).to(torch.bfloat16)
    x = torch.randn(rows, 640, generator=gen).to(torch.bfloat16)
    best = _full_argmax(weight, x)[0]
    for row in (5, 6, 2999):  # the winner with one value nudged by one bf16 step
        weight[row] = weight[best]
        weight[row, row % 640] = torch.nextafter(weight[best, row % 640].float(), torch.tensor(1.0)).to(torch.bfloat16)
    with torch.inference_mode():
        assert GreedyHead(weight).argmax(x) == _full_argmax(weight, x)


def test_candidates_rescored_alone_are_the_heads_own_logits(ops):
    """The exact pass over the gathered candidate rows gives the full head's logits at those rows, bit for bit."""
    gen = torch.Generator().manual_seed(4)
    weight = (torch.randn(4099, 640, generator=gen) * 0.05).to(torch.bfloat16)
    greedy = GreedyHead(weight)
    x = torch.randn(3, 640, generator=gen).to(torch.bfloat16)
    candidates = ops[1](*greedy.packed, x)
    assert candidates.shape[1] == 2 and set(candidates[:, 0].tolist()) == {0, 1, 2}
    full = decode_linear.load()(weight, x)
    rows = decode_linear.load()(weight.index_select(0, candidates[:, 1]), x)
    assert torch.equal(rows, full[:, candidates[:, 1]])


@pytest.mark.parametrize("in_features", [640, 2048])  # 2048: one row's chain differs from several rows'
@pytest.mark.parametrize("rows", [1, 4, 16])
def test_candidates_rescored_from_the_head_as_it_is_are_the_products_own_logits(in_features, rows):
    """Where the products run on ``bf16_linear``, each candidate's logit is computed alone from the bf16 head
    (``bf16_rescore``: no gathered, packed copy, no other row's candidates): the product's element there, bit for
    bit, for every row count and its chain length."""
    rescore = decode_linear.rescorer()
    if rescore is None:
        pytest.skip("the products do not run on bf16_linear here: candidates are gathered and multiplied")
    gen = torch.Generator().manual_seed(in_features + rows)
    weight = (torch.randn(3001, in_features, generator=gen) * 0.05).to(torch.bfloat16)
    x = torch.randn(rows, in_features, generator=gen).to(torch.bfloat16)
    picks = [(r, int(v)) for r in range(rows)  # 1-40 per row: full vectors of 16 and partial ones
             for v in torch.randperm(3001, generator=gen)[:int(torch.randint(1, 41, (1,), generator=gen))].sort()[0]]
    candidates = torch.tensor(picks, dtype=torch.long)
    full = decode_linear.load()(weight, x)
    got = rescore(weight, x, candidates)
    assert torch.equal(got.view(torch.int16), full[candidates[:, 0], candidates[:, 1]].view(torch.int16))
    with pytest.raises(RuntimeError, match="outside x or the weight"):
        rescore(weight, x, torch.tensor([[0, 3001]]))
    with pytest.raises(RuntimeError, match="outside x or the weight"):
        rescore(weight, x, torch.tensor([[rows, 0]]))


def test_where_the_screen_cannot_apply_it_stands_aside(ops):
    gen = torch.Generator().manual_seed(5)
    weight = (torch.randn(2000, 640, generator=gen) * 0.05).to(torch.bfloat16)
    greedy = GreedyHead(weight)
    greedy.grouped = False  # AMX's rule: past one call's rows the full head is cheaper
    assert greedy.argmax(torch.randn(greedy.max_rows + 1, 640).to(torch.bfloat16)) is None  # too many rows
    greedy.grouped = True
    bad = torch.randn(1, 640).to(torch.bfloat16)
    bad[0, 3] = float("nan")
    assert greedy.argmax(bad) is None
    assert install_greedy_head(_head(weight), softcap=30.0) is None  # soft-capped logits: not screened
    plain = torch.nn.Linear(640, 2000, bias=False).to(torch.bfloat16)
    assert install_greedy_head(plain, softcap=None) is None  # a head not on the decode kernel
    assert isinstance(install_greedy_head(_head(weight), softcap=None), GreedyHead)


def test_a_screen_that_disagrees_with_the_head_is_not_installed(ops, monkeypatch):
    monkeypatch.setattr(GreedyHead, "argmax", lambda self, hidden: [0] * hidden.shape[0])
    weight = (torch.randn(2000, 640) * 0.05).to(torch.bfloat16)
    assert install_greedy_head(_head(weight), softcap=None) is None


def _greedy_decode(engine, screen: bool, **sampling) -> list[int]:
    loaded = engine.loaded
    saved = loaded.greedy
    if not screen:
        loaded.greedy = None
    try:
        loop = engine.serving_loop()
        out = []
        for q in ("where did caroline go?", "what is the plan for the weekend"):
            req = GenRequest(ids=engine.question_ids(q), blocks=[], mode="none", emit=lambda e: None,
                             sampling=Sampling(max_new_tokens=24, **(sampling or {"ignore_eos": True})))
            loop.add(req)
            loop.run_until_done()
            out.append(req.output)
        return out
    finally:
        loaded.greedy = saved


def _screened_decode(engine, **sampling) -> tuple[list[list[int]], int]:
    """``_greedy_decode`` with the screen, and how many times the screen was asked."""
    calls = []
    original = greedyhead.GreedyHead.argmax
    greedyhead.GreedyHead.argmax = lambda self, hidden: calls.append(1) or original(self, hidden)
    try:
        return _greedy_decode(engine, screen=True, **sampling), len(calls)
    finally:
        greedyhead.GreedyHead.argmax = original


def test_a_greedy_decode_says_the_same_tokens_screened(ops):
    engine = tm.engine("gemma3", dtype=torch.bfloat16, sliding_window=8)
    assert engine.loaded.greedy is not None, "a bf16 Gemma-3 on the decode kernel gets the screen"
    screened, calls = _screened_decode(engine)
    assert calls, "decode steps went through the screen"
    assert screened == _greedy_decode(engine, screen=False)


def test_min_tokens_keeps_the_screen_and_the_tokens(ops):
    """``min_tokens`` bans the stop tokens until reached: a screened argmax that is not one of them is still the
    token (the first maximum of those the row may choose), so forced lengths decode through the screen too."""
    engine = tm.engine("gemma3", dtype=torch.bfloat16, sliding_window=8)
    screened, calls = _screened_decode(engine, min_tokens=24)
    assert calls >= 2 * 23, "every decode step went through the screen"
    assert screened == _greedy_decode(engine, screen=False, min_tokens=24)
    assert all(len(out) == 24 and not set(out) & engine.stop_ids for out in screened)
