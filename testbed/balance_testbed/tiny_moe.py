"""A tiny Qwen3-MoE checkpoint and a locally trained tokenizer, made at test time.

Nothing is downloaded and nothing large is committed: the weights come from a seeded
``from_config`` (the same bytes every run), the tokenizer is a byte-level BPE trained with
``tokenizers`` on ``CORPUS``. The architecture is a real MoE (8 experts, top-2), so vLLM at
``data_parallel_size > 1`` runs ``DPEngineCoreProc`` and its MoE layers join the DP collectives
on every forward, exactly where the balance gather interleaves with them.

The tokenizer's alphabet is only the characters of the corpus (no byte fallback), so any token a
random model emits decodes to printable text, and the model's vocabulary is exactly the
tokenizer's: no id it can sample is undecodable.

``initializer_range`` is large on purpose: with the usual 0.02 a random model's logits are
nearly flat, so greedy decoding would hinge on rounding noise; wide weights give clear argmax
margins, which is what makes "same text with balance off and on" a meaningful comparison.

    python -m balance_testbed.tiny_moe <dir>      # what the docs' "try it on a laptop" runs
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

EOS = "<|endoftext|>"
# A ChatML-like template: the chat endpoint needs one, and the tokenizer has none of its own.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = [EOS, "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "Balance scheduling keeps data parallel ranks of a mixture of experts model in step.",
    "Every engine step each rank gathers how many requests it is running.",
    "When any rank is at the cap, no rank admits a waiting request this step.",
    "The gather sits right after the ranks agree on whether any work is left.",
    "A rank that has drained runs a dummy batch so the expert collectives still meet.",
    "Tokens flow through attention, then a router picks two of eight experts.",
    "The quick brown fox jumps over the lazy dog while the scheduler counts.",
    "Small models make fast tests; real processes make honest ones.",
    "Requests arrive, wait, run, finish, and free their cache blocks again.",
    "One two three four five six seven eight nine ten eleven twelve.",
]
# Upper bound for BPE training; the corpus yields ~320 tokens, which become the model's vocab.
MAX_VOCAB_SIZE = 1024
SEED = 0


def train_tokenizer():
    """A byte-level BPE fast tokenizer trained on ``CORPUS`` (a ``PreTrainedTokenizerFast``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=MAX_VOCAB_SIZE, special_tokens=SPECIAL_TOKENS)
    bpe.train_from_iterator(CORPUS * 4, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS, pad_token=EOS)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def moe_config(tokenizer, dtype: str, **sizes):
    """The tests' tiny Qwen3-MoE; ``sizes`` overrides fields (``nox -s bench-serve`` widens it)."""
    from transformers import Qwen3MoeConfig

    fields = dict(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=512,
        initializer_range=0.2,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        architectures=["Qwen3MoeForCausalLM"],
        dtype=dtype,
    )
    return Qwen3MoeConfig(**{**fields, **sizes})


def make_tiny_moe(directory: Path, dtype: str = "bfloat16", **sizes) -> Path:
    """Write the checkpoint and tokenizer into ``directory``; returns it. Deterministic.

    ``sizes``: ``Qwen3MoeConfig`` fields to override (none for the tests' model)."""
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = train_tokenizer()
    config = moe_config(tokenizer, dtype, **sizes)
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype))
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    # Recorded beside the weights: what a reader of a failing run wants to know first.
    params = sum(p.numel() for p in model.parameters())
    (directory / "made-by.json").write_text(
        json.dumps(
            {
                "maker": "balance_testbed.tiny_moe",
                "seed": SEED,
                "parameters": params,
                "dtype": dtype,
                "sizes": sizes,
            }
        )
    )
    return directory


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    return parser


if __name__ == "__main__":
    args = build_parser().parse_args()
    print(make_tiny_moe(args.directory, args.dtype))
