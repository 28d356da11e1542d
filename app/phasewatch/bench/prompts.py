"""Prompts of an exact token count: counted by the server, else a local tokenizer, else estimated.

A prompt is the article's `"word " * n` (plus single-token fillers where a word costs several
tokens), counted and corrected until the count is the one asked for. Who counts, in order of
preference:

1. the server's own `POST /tokenize` (vLLM and phasewatch's simulator serve it; phasewatch
   relays it to its upstream): exact for the model that answers;
2. a local tokenizer, when `--tokenizer PATH` names a `tokenizer.json` (or a directory holding
   one) and the `tokenizers` package is installed, or `transformers` is installed and finds
   the model's tokenizer in its local cache (nothing is downloaded): exact as far as the local
   files match the served model;
3. an estimate of one token per word, which every report labels approximate.

`PromptBuilder.method` says which one was used; it is stored with the run. Neither optional
package is imported unless a local tokenizer is needed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from phasewatch.bench.errors import WorkloadError

SERVER, LOCAL, ESTIMATE = "server", "local", "estimate"


@dataclass(frozen=True, slots=True)
class Prompt:
    text: str
    tokens: int  # as counted by `method`; an estimate when `method` is "estimate"
    method: str

    @property
    def exact(self) -> bool:
        return self.method != ESTIMATE


def local_counter(tokenizer: str | None, model: str) -> Callable[[str], int] | None:
    """A local token counter, or None when no local tokenizer can be had without a download."""
    if tokenizer is not None:
        path = Path(tokenizer)
        file = path / "tokenizer.json" if path.is_dir() else path
        if file.is_file():
            try:
                from tokenizers import Tokenizer  # type: ignore[import-not-found, unused-ignore]
            except ImportError:
                pass
            else:
                local: Any = Tokenizer.from_file(str(file))
                return lambda text: len(local.encode(text).ids)
    try:
        from transformers import AutoTokenizer  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        return None
    try:
        auto: Any = AutoTokenizer.from_pretrained(tokenizer or model, local_files_only=True)
    except (OSError, ValueError):
        return None
    return lambda text: len(auto(text)["input_ids"])


class PromptBuilder:
    """Builds exact-length prompts for one model on one server, with the best counter found."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, model: str,
                 tokenizer: str | None = None) -> None:
        self.session = session
        self.base_url = base_url
        self.model = model
        self.tokenizer = tokenizer
        self.method = ""
        self._local: Callable[[str], int] | None = None
        self._cache: dict[int, Prompt] = {}

    async def _server_count(self, text: str) -> int | None:
        try:
            async with self.session.post(
                self.base_url + "/tokenize",
                data=orjson.dumps({"model": self.model, "prompt": text}),
                headers={"content-type": "application/json"},
            ) as response:
                if response.status != 200:
                    return None
                body = await response.json(loads=orjson.loads, content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None
        count = body.get("count") if isinstance(body, dict) else None
        return count if isinstance(count, int) else None

    async def choose(self) -> str:
        """Pick the counter: the server's if it answers, else a local one, else the estimate."""
        if not self.method:
            if await self._server_count("word") is not None:
                self.method = SERVER
            else:
                self._local = local_counter(self.tokenizer, self.model)
                self.method = LOCAL if self._local is not None else ESTIMATE
        return self.method

    async def count(self, text: str) -> int:
        method = await self.choose()
        if method == SERVER:
            found = await self._server_count(text)
            if found is None:
                raise WorkloadError(f"{self.base_url}/tokenize stopped answering")
            return found
        if method == LOCAL:
            assert self._local is not None
            return self._local(text)
        return len(text.split())

    async def prompt(self, tokens: int) -> Prompt:
        """A prompt of exactly `tokens` tokens (or about that many, by estimate)."""
        if tokens not in self._cache:
            method = await self.choose()
            self._cache[tokens] = Prompt(await self._build(tokens), tokens, method)
        return self._cache[tokens]

    async def _build(self, tokens: int) -> str:
        """"word " repeated as often as fits, then single-token fillers up to the count.

        Tokenizers split "word " into one token or several, and may add special tokens, so
        the count is taken as linear in the words (measured at 1 and 2 words), checked, and the
        rest is filled with short strings that most tokenizers count as one token each."""
        one, two = await self.count("word "), await self.count("word " * 2)
        per_word, fixed = max(1, two - one), one - max(1, two - one)
        words = max(1, (tokens - fixed) // per_word)
        found = await self.count("word " * words)
        while found > tokens and words > 1:
            words = max(1, words - math.ceil((found - tokens) / per_word))
            found = await self.count("word " * words)
        base = "word " * words
        if found == tokens:
            return base
        for filler in ("a ", "x", "\n", "!"):
            extra = tokens - found
            for _ in range(4):
                if extra < 0:
                    break
                text = base + filler * extra
                counted = await self.count(text)
                if counted == tokens:
                    return text
                extra += tokens - counted
        raise WorkloadError(
            f"could not build a prompt of exactly {tokens} tokens for {self.model} "
            f"(counted by {self.method}; one word is {per_word} token(s), {fixed} more fixed)"
        )
