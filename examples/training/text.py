"""A deterministic, learnable character corpus (generated, never downloaded) and its batches.

Sentences come from a small grammar with number agreement and arithmetic:

  the small cat chases a red ball.   two dogs see the cats.   7 plus 5 is 12.

A character model first learns the spelling of the words (most characters
are then predictable), then the grammar (plural nouns take plural verbs),
then some arithmetic, so the loss keeps falling at every model size.
"""

from __future__ import annotations

import numpy as np

NOUNS = [
    "cat",
    "dog",
    "bird",
    "fox",
    "horse",
    "ball",
    "tree",
    "house",
    "river",
    "ship",
    "king",
    "queen",
    "child",
    "robot",
    "lamp",
    "book",
]
PLURALS = {"fox": "foxes", "child": "children"}
VERBS = ["chase", "see", "like", "find", "push", "watch", "follow", "draw", "help", "carry"]
THIRD_PERSON = {"push": "pushes", "watch": "watches", "carry": "carries"}
ADJECTIVES = ["small", "big", "red", "green", "old", "young", "happy", "quiet", "fast", "blue"]
NUMBERS = ["two", "three", "four", "five", "six"]


def _noun_phrase(rng: np.random.Generator) -> tuple[str, bool]:
    """(phrase, is_plural), e.g. ("the old foxes", True)."""
    noun = NOUNS[rng.integers(len(NOUNS))]
    plural = rng.random() < 0.4
    words = []
    if plural:
        words.append(["the", "some", NUMBERS[rng.integers(len(NUMBERS))]][rng.integers(3)])
    else:
        words.append(["the", "a", "one"][rng.integers(3)])
    if rng.random() < 0.5:
        words.append(ADJECTIVES[rng.integers(len(ADJECTIVES))])
    words.append(PLURALS.get(noun, noun + "s") if plural else noun)
    return " ".join(words), plural


def _sentence(rng: np.random.Generator) -> str:
    if rng.random() < 0.2:  # arithmetic: the answer is determined by the question
        a, b = rng.integers(0, 20, size=2)
        if rng.random() < 0.5:
            return f"{a} plus {b} is {a + b}."
        a, b = max(a, b), min(a, b)
        return f"{a} minus {b} is {a - b}."
    subject, plural = _noun_phrase(rng)
    verb = VERBS[rng.integers(len(VERBS))]
    if not plural:  # agreement: a singular subject takes the -s form
        verb = THIRD_PERSON.get(verb, verb + "s")
    obj, _ = _noun_phrase(rng)
    return f"{subject} {verb} {obj}."


def generate_corpus(num_chars: int = 200_000, seed: int = 0) -> str:
    """At least `num_chars` characters of sentences, the same for the same seed."""
    rng = np.random.default_rng(seed)
    parts, length = [], 0
    while length < num_chars:
        s = _sentence(rng)
        parts.append(s)
        length += len(s) + 1
    return " ".join(parts)


class CharVocab:
    """Character <-> id mapping over the characters of a text (sorted: deterministic)."""

    def __init__(self, text: str):
        self.chars = sorted(set(text))
        self._ids = {c: i for i, c in enumerate(self.chars)}

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> np.ndarray:
        return np.array([self._ids[c] for c in text], dtype=np.int32)

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)


def batch_at(data: np.ndarray, step: int, batch: int, seq: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The batch of training step `step`: (inputs, targets), each int32 [batch, seq].

    A pure function of (seed, step), so a resumed run sees the same batches as
    an uninterrupted one. targets are inputs shifted by one character.
    """
    if len(data) < seq + 2:
        raise ValueError(f"the corpus ({len(data)} tokens) is shorter than seq + 1 = {seq + 1}")
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(data) - seq - 1, size=batch)
    windows = data[starts[:, None] + np.arange(seq + 1)[None, :]]
    return windows[:, :-1], windows[:, 1:]
