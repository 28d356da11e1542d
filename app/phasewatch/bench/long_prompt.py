"""How long the interference's long prompt is, and whether chunked prefill can matter at all.

Pure: numbers in, a length and sentences out. Chunked prefill splits a prefill across steps of
at most `max_num_batched_tokens` (the budget) tokens, so it changes the short stream's stall only
when the long prompt does not fit in one step beside the short stream's decode token. A default
length that fits (an 8,000-token prompt under vLLM's 8,192-token budget on GPUs of 70 GiB and
more) shows the same stall with chunking on and off. So, unless `--long-prompt-tokens` says:

- with a known budget B (the simulator's `/version`, vLLM's `/server_info`) and chunked prefill
  on (or about to be switched on), the prompt is 4 x B: on, it runs as four chunks, each
  stalling the short stream for about a quarter of the prefill; off, as one step;
- otherwise (no budget reported, or chunked prefill off, where the budget is raised to
  max_model_len and says nothing about chunks) 16,384 tokens: twice vLLM's largest default
  budget;

both capped so that prompt and output fit `max_model_len`. When the length fits in one step
(given, or capped by a short max_model_len), `same_step` says why on and off cannot differ.
"""

from __future__ import annotations

from dataclasses import dataclass

CHUNKS = 4  # the default prompt is this many budgets long
UNKNOWN_BUDGET_TOKENS = 16384  # 2 x 8192, vLLM's largest default max_num_batched_tokens


@dataclass(frozen=True, slots=True)
class LongPrompt:
    tokens: int
    how: str  # where the length came from, for the report
    same_step: str | None  # why chunked prefill on and off cannot differ, when they cannot


def size_long_prompt(
    asked: int | None, budget: int | None, chunked: bool | None, max_model_len: int | None,
    long_max_tokens: int,
) -> LongPrompt:
    """The long prompt's length. `budget` is max_num_batched_tokens with chunked prefill on
    (`chunked` is the setting the budget was read under; None when unknown)."""
    cap = None if max_model_len is None else max(1, max_model_len - long_max_tokens)
    usable = budget if chunked else None  # off, the budget is max_model_len: no chunk size
    if asked is not None:
        tokens, how = asked, f"{asked} tokens, as asked (--long-prompt-tokens)"
    elif usable is not None:
        tokens = CHUNKS * usable
        how = (f"{tokens} tokens by default: {CHUNKS} x the server's max_num_batched_tokens "
               f"{usable}, so chunked prefill splits it into {CHUNKS} steps")
    else:
        tokens = UNKNOWN_BUDGET_TOKENS
        why = ("chunked prefill is off, so its budget says nothing about chunks" if chunked
               is False else "the server did not report its max_num_batched_tokens")
        how = (f"{tokens} tokens by default ({why}): twice vLLM's largest default budget, "
               "8192")
    if asked is None and cap is not None and tokens > cap:
        tokens = cap
        how += f"; capped at {cap} so that prompt and output fit max_model_len {max_model_len}"
    return LongPrompt(tokens, how, _same_step(tokens, usable, cap, max_model_len))


def _same_step(tokens: int, budget: int | None, cap: int | None,
               max_model_len: int | None) -> str | None:
    # The short stream's decode takes one token of the step's budget first.
    if budget is None or tokens > budget - 1:
        return None
    reason = (f"the {tokens}-token prompt fits in one step of max_num_batched_tokens {budget} "
              "beside the short stream's token, so chunked prefill has nothing to split: on "
              "and off stall the short stream alike.")
    if cap is not None and cap <= budget - 1:
        return reason + (f" max_model_len {max_model_len} allows no longer prompt: lower the "
                         "server's --max-num-batched-tokens to see chunking work.")
    return reason + f" Pass --long-prompt-tokens above {budget - 1} to see the difference."
