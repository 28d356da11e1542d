"""Build, offline, the small model the real-vLLM tests serve: Qwen2 with random weights.

Run by tests/vllm/env.sh with the vLLM env's Python (it needs torch, transformers and tokenizers,
which the test suite's own venv does not have): `python build_model.py OUT_DIR`.

What it makes, deterministically (fixed seeds, a generated corpus; nothing is downloaded):
- a byte-level BPE tokenizer trained here with `tokenizers` on a generated pseudo-English
  corpus, with ChatML's special tokens and a ChatML chat template (as Qwen2 instruct models);
- a Qwen2 model, hidden 256, 4 layers, about 5 M parameters, random weights (float32), saved
  with `save_pretrained`. Random weights emit gibberish, so clients send `ignore_eos: true` and
  `max_tokens` to get outputs of the length they ask for.

Sized so that on 2 CPU cores prefilling a few thousand tokens takes visibly longer (hundreds of
ms) than a short prompt (tens of ms), while decoding stays a few ms per token.

It must not import phasewatch: it runs in another interpreter.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    GenerationConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

VOCAB_SIZE = 4096  # tokenizer's vocabulary; the model's embedding is rounded up to 64
HIDDEN = 256
LAYERS = 4
HEADS = 4  # head_dim 64, a size vLLM's CPU attention supports
KV_HEADS = 2  # grouped-query attention, as Qwen2
INTERMEDIATE = 1024
MAX_POSITIONS = 8192

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# ChatML, as Qwen2 instruct models write it (without the default system prompt).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_ONSETS = ["", "b", "c", "d", "f", "g", "h", "l", "m", "n", "p", "r", "s", "t", "v", "w",
           "br", "ch", "cl", "st", "th", "tr", "sh", "pr"]
_VOWELS = ["a", "e", "i", "o", "u", "ea", "ou", "ai", "io"]
_CODAS = ["", "", "n", "s", "t", "r", "l", "ng", "st", "ck", "m"]


def corpus(lines: int = 20_000, seed: int = 0) -> Iterator[str]:
    """Pseudo-English sentences from a seeded generator, with digits and punctuation."""
    rng = random.Random(seed)
    lexicon = [
        "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
                for _ in range(rng.choice([1, 1, 2, 2, 3])))
        for _ in range(3000)
    ]
    for _ in range(lines):
        words = [rng.choice(lexicon) for _ in range(rng.randint(4, 18))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 9999)))
        sentence = " ".join(words)
        yield sentence[0].upper() + sentence[1:] + rng.choice([".", ".", "?", "!", ","])


def build_tokenizer() -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # any byte can be encoded
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=MAX_POSITIONS,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(tokenizer: PreTrainedTokenizerFast) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=-(-len(tokenizer) // 64) * 64,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.eos_token_id,
        torch_dtype="float32",
    )
    return Qwen2ForCausalLM(config).eval()


def main(out_dir: Path) -> None:
    tokenizer = build_tokenizer()
    model = build_model(tokenizer)
    model.generation_config = GenerationConfig(
        bos_token_id=model.config.bos_token_id,
        eos_token_id=model.config.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    params = sum(p.numel() for p in model.parameters())
    print(f"build_model: {params / 1e6:.2f} M parameters, vocab {len(tokenizer)}, in {out_dir}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: build_model.py OUT_DIR")
    main(Path(sys.argv[1]))
