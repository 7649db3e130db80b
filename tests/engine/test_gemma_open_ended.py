"""On the real default model, open-ended questions (whose answers Gemma-3 opens with a line break) get answers in
every mode, through the serving loop the server runs."""

import pytest

from inferscale.engine import Engine, MemoryItem, Sampling

pytestmark = pytest.mark.slow

ITEMS = ["Ilse moved to Porto in 2019 to work as an architect.",
         "Ilse spends her weekends surfing at Matosinhos beach.",
         "Ilse plays cello in a small amateur orchestra.",
         "Ilse grows tomatoes and herbs on her balcony."]


@pytest.mark.parametrize("mode", ["kv", "text", "none", "kv-recompute"])
def test_open_ended_questions_get_answers(mode):
    gemma = _gemma()
    blocks = gemma.encode([MemoryItem(f"m{i}", t) for i, t in enumerate(ITEMS)])
    for question in ("Describe Ilse's life in Porto", "What are Ilse's hobbies? Explain each of them."):
        answer = gemma.ask(question, blocks, mode, sampling=Sampling(max_new_tokens=24))
        assert answer.text.strip() and answer.token_ids, (mode, question)


_cached: list[Engine] = []


def _gemma() -> Engine:
    if not _cached:
        _cached.append(Engine.load("gemma-3-270m"))
    return _cached[0]
