from inferscale.engine.engine import MODES, Answer, Engine, Sequence
from inferscale.engine.sampling import Sampling
from inferscale.engine.template import DEFAULT_TEMPLATE, MemoryItem, PromptTemplate, read_jsonl

__all__ = ["MODES", "Answer", "Engine", "Sampling", "Sequence", "DEFAULT_TEMPLATE", "MemoryItem", "PromptTemplate",
           "read_jsonl"]
