"""A built-in set of LoCoMo-like memories (personal facts of 20-35 tokens), seeded and reproducible."""

from __future__ import annotations

import random

from inferscale.engine.template import MemoryItem

_PEOPLE = ["Caroline", "Melanie", "Jon", "Gina", "Audrey", "Andrew", "Maria", "John", "Nate", "Joanna", "Tim", "Deborah"]
_ACTIVITIES = [
    "went camping with her kids near the lake", "started a pottery class at the community center",
    "adopted a rescue dog named Oscar", "ran a charity race to raise money for the shelter",
    "painted a sunrise over the water", "joined an LGBTQ support group", "visited her grandmother in Sweden",
    "opened a small dance studio downtown", "lost his job at the bank and began a new business",
    "read a novel about a family of immigrants", "took a road trip along the coast with friends",
    "volunteered at the animal shelter every weekend", "signed up for a photography workshop",
    "bought a used guitar and started taking lessons", "planted tomatoes and herbs in the garden",
]
_DETAILS = [
    "and said it made her feel calm and accepted", "because he wanted to spend more time outdoors",
    "after a long and stressful month at work", "which reminded her of her childhood summers",
    "and plans to do it again next year with the whole family", "together with two close friends from college",
    "and posted photos of it for everyone to see", "since it helps him relax after a long day",
]
_DATES = ["7 May 2023", "25 May 2023", "9 June 2023", "27 June 2023", "3 July 2023", "14 August 2023",
          "22 August 2023", "13 September 2023", "20 October 2023", "2 November 2023"]
QUESTIONS = [
    "When did Caroline go to the support group?", "What did Melanie paint recently?",
    "What kind of pet did Jon adopt?", "Where did Gina travel with her friends?",
    "What class did Audrey sign up for?", "Why did Andrew start a new business?",
]


def synthetic_memories(n: int, tokenizer, *, seed: int = 0, min_tokens: int = 20, max_tokens: int = 35) -> list[MemoryItem]:
    """``n`` facts whose rendered token count lies in [min_tokens, max_tokens] for ``tokenizer``."""
    rng = random.Random(seed)
    items: list[MemoryItem] = []
    while len(items) < n:
        text = f"{rng.choice(_PEOPLE)} {rng.choice(_ACTIVITIES)} {rng.choice(_DETAILS)}."
        item = MemoryItem(id=f"syn-{len(items):04d}", text=text, timestamp=rng.choice(_DATES))
        if min_tokens <= len(tokenizer(f"- ({item.timestamp}) {text}\n", add_special_tokens=False).input_ids) <= max_tokens:
            items.append(item)
    return items


def put_body(items: list[MemoryItem]) -> dict:
    """The ``PUT /v1/memories/{user}`` body that stores ``items`` as they are, dates included: a memory's date is
    part of what the set's 20-35 tokens measure, and what a question about when something happened needs."""
    return {"items": [{"id": it.id, "text": it.text, "timestamp": it.timestamp} for it in items]}
