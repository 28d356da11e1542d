"""The simulator's tokenizer and text generator: simple, deterministic and documented.

- A prompt is one token per whitespace-separated word, so `"word " * n` is exactly n tokens.
  A word's id is a CRC-32 of it, folded into the vocabulary (ids below `SPECIAL_IDS` are kept
  for the chat template's special tokens).
- A chat prompt adds the template's tokens: `CHAT_TOKENS_PER_MESSAGE` per message (ChatML's
  `<|im_start|>`, role, newline, `<|im_end|>`, newline) and `CHAT_GENERATION_PROMPT_TOKENS` for
  the assistant turn opener (`<|im_start|>`, `assistant`, newline).
- Output is pseudo-words, one token each, chosen by a seeded hash of (seed, position): the same
  seed gives the same text. Every output token's text is a space and the word.
- Detokenizing maps every id to its pseudo-word, so it round-trips the sim's output tokens but
  not arbitrary prompt words (their ids are hashes).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Sequence
from typing import Any

CHAT_TOKENS_PER_MESSAGE = 5
CHAT_GENERATION_PROMPT_TOKENS = 3

SPECIAL_IDS = 1024
IM_START_ID = 1
IM_END_ID = 2
NEWLINE_ID = 3

_CONSONANTS = "bdfghklmnprstvz"
_VOWELS = "aeiou"
_SYLLABLES = [c + v for c in _CONSONANTS for v in _VOWELS]  # 75 syllables


class Tokenizer:
    def __init__(self, vocab_size: int, seed: int = 0) -> None:
        if vocab_size <= SPECIAL_IDS:
            raise ValueError(f"vocab_size must exceed {SPECIAL_IDS}")
        self.vocab_size = vocab_size
        self.seed = seed
        self._span = vocab_size - SPECIAL_IDS

    # -- prompts -------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        return [self.word_id(word) for word in text.split()]

    def count(self, text: str) -> int:
        return len(text.split())

    def word_id(self, word: str) -> int:
        return SPECIAL_IDS + zlib.crc32(word.encode()) % self._span

    def encode_chat(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool
    ) -> list[int]:
        ids: list[int] = []
        for message in messages:
            ids += [IM_START_ID, self.word_id(str(message.get("role", "")))]
            ids += [NEWLINE_ID, *self.encode(message_text(message)), IM_END_ID, NEWLINE_ID]
        if add_generation_prompt:
            ids += [IM_START_ID, self.word_id("assistant"), NEWLINE_ID]
        return ids

    def count_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool) -> int:
        total = sum(
            CHAT_TOKENS_PER_MESSAGE + self.count(message_text(message)) for message in messages
        )
        return total + (CHAT_GENERATION_PROMPT_TOKENS if add_generation_prompt else 0)

    # -- output --------------------------------------------------------------------------------

    def output_id(self, seed: int, index: int) -> int:
        # A 64-bit mix (splitmix64's finalizer) of seed and position.
        z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        z ^= z >> 31
        return SPECIAL_IDS + z % self._span

    def output_text(self, seed: int, index: int) -> str:
        return " " + pseudo_word(self.output_id(seed, index))

    def decode(self, ids: Iterable[int]) -> str:
        return "".join(
            {IM_START_ID: "<|im_start|>", IM_END_ID: "<|im_end|>", NEWLINE_ID: "\n"}.get(i)
            or " " + pseudo_word(i)
            for i in ids
        )


def pseudo_word(token_id: int) -> str:
    """Two or three syllables spelled from the id: pronounceable, and one token by construction."""
    n = token_id
    word = _SYLLABLES[n % 75] + _SYLLABLES[(n // 75) % 75]
    if n // 5625 % 2:
        word += _SYLLABLES[(n // 11250) % 75]
    return word


def message_text(message: dict[str, Any]) -> str:
    """A chat message's text: a string, or the text parts of a content list."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return " ".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
