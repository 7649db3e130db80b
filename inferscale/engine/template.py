"""The prompt template shared by every mode, and memory items.

A prompt is   [memory prefix] [item 1] ... [item k] [question]
and its token ids are the concatenation of each part tokenized on its own. ``text`` mode prefills exactly these
ids; ``kv`` mode injects the items' cached KV instead. So the modes differ only in how memory tokens get their KV.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from inferscale.contract import id_problem
from inferscale.errors import MemoryItemError


@dataclass(frozen=True)
class MemoryItem:
    id: str
    text: str
    timestamp: str | None = None

    def __post_init__(self) -> None:
        problem = id_problem("memory id", self.id)
        if problem:
            raise MemoryItemError(problem)
        if not isinstance(self.text, str) or not self.text.strip():
            raise MemoryItemError(f"memory {self.id!r}: text is empty")
        if self.timestamp is not None and not isinstance(self.timestamp, str):
            raise MemoryItemError(f"memory {self.id!r}: timestamp must be a string")

    @classmethod
    def from_dict(cls, d: dict, *, where: str = "") -> MemoryItem:
        if not isinstance(d, dict):
            raise MemoryItemError(f"{where}: expected an object with id and text")
        unknown = set(d) - {"id", "text", "timestamp"}
        if unknown:
            raise MemoryItemError(f"{where}: unknown field(s) {sorted(unknown)}")
        if "id" not in d or "text" not in d:
            raise MemoryItemError(f"{where}: needs both 'id' and 'text'")
        ts = d.get("timestamp")
        return cls(id=d["id"], text=d["text"], timestamp=None if ts in (None, "") else str(ts))


def read_jsonl(path: str) -> list[MemoryItem]:
    """Parse a JSONL file of memory items; errors name the file and line."""
    items: list[MemoryItem] = []
    seen: set[str] = set()
    try:
        lines = open(path, encoding="utf-8").read().splitlines()
    except OSError as e:
        raise MemoryItemError(f"{path}: cannot read ({e.strerror or e})") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise MemoryItemError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        item = MemoryItem.from_dict(obj, where=f"{path}:{n}")
        if item.id in seen:
            raise MemoryItemError(f"{path}:{n}: duplicate memory id {item.id!r}")
        seen.add(item.id)
        items.append(item)
    return items


@dataclass(frozen=True)
class PromptTemplate:
    # The two opening lines are part of the shared prefix on purpose: every item is encoded after this prefix,
    # and an item encoded right after a bare header is encoded as "the first line of the list". Injected k at a
    # time, k "first lines" mislead the model. On LoCoMo dev data (conv-26, k=20) the opening lines cut the KL
    # between kv and text next-token distributions from 1.6 to 0.34; lines without dates did not help (1.6).
    # Items are also encoded behind the real memories before them (encoder.py); these lines matter for the first.
    prefix: str = (
        "Facts about the user, remembered from past conversations:\n"
        "- (1 January 2023) The user started talking with the assistant.\n"
        "- (2 January 2023) The user shared some news about friends and family.\n"
    )
    item: str = "- {text}\n"
    item_with_time: str = "- ({timestamp}) {text}\n"
    # The instruction's 17 tokens are prefilled on every request (after the memories, so not cacheable). Moved into
    # the prefix, kv's question pass was 22 % shorter, but on 120 held-out LoCoMo questions kv's first-token
    # agreement with text fell 0.77 -> 0.75 (k=20) and 0.78 -> 0.73 (k=50), and text's F1 at k=20 0.171 -> 0.137
    # (README, "The instruction stays next to the question").
    question: str = "\nAnswer the question in a few words, using the facts above.\nQuestion: {question}\nAnswer:"
    chat_turn: str = "{role}: {content}\n"
    chat_open: str = "\nConversation:\n"
    chat_reply: str = "Assistant:"
    # The model profile's default stop sequences: the template asks for an answer "in a few words", so a line
    # break ends it (matched once visible text was said). A request's own ``stop`` replaces them; GET /v1/models
    # shows them (the ``inferscale.default_stop`` field of the model card).
    default_stop: tuple[str, ...] = ("\n",)

    def render_item(self, item: MemoryItem) -> str:
        if item.timestamp:
            return self.item_with_time.format(text=item.text.strip(), timestamp=item.timestamp)
        return self.item.format(text=item.text.strip())

    def render_question(self, question: str) -> str:
        return self.question.format(question=question.strip())

    def render_chat(self, messages: list[tuple[str, str]]) -> str:
        """A chat (role, content) list after the memories; the model continues as the assistant."""
        turns = "".join(self.chat_turn.format(role=role.capitalize(), content=content.strip()) for role, content in messages)
        return self.chat_open + turns + self.chat_reply

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.__dict__, sort_keys=True).encode()).hexdigest()


DEFAULT_TEMPLATE = PromptTemplate()
