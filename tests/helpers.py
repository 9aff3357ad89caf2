"""Shared test data: prompts of different lengths and the compressors every parametrised test sweeps."""

from compressors.h2o import H2O
from compressors.snapkv import SnapKV
from compressors.streaming_llm import StreamingLLM

# Every method in this list is tested by the parametrised tests the moment it is added.
SELECTION_METHODS = [StreamingLLM, H2O, SnapKV]

CONTEXTS = [
    "The grass is green. The sky is blue. The sun is yellow. " * 12,
    "Here we go. There and back again. " * 7 + "The magic number is 4172. " + "Here we go. " * 5,
    "A short context about apples and pears. " * 3,
]
QUESTIONS = ["\nWhat color is the sky?", "\nWhat is the magic number?", "\nWhich fruits?"]
