"""TEST SCAFFOLDING: build a tiny random-weight Qwen2 model + byte-level BPE tokenizer.

Run with the SGLang venv's python (needs torch, transformers, tokenizers):
    python tests/sglang/tiny_model.py OUT_DIR
Deterministic (fixed seed), ~0.3 MB, built in a few seconds. A byte-level BPE is required: with
transformers 5 a WordLevel tokenizer encodes everything to [] and crashes the scheduler.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build(out: Path) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return out
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = [f"program {i} step {j} tool call result ok" for i in range(50) for j in range(5)]
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        bos_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        eos_token_id=0,
        bos_token_id=0,
        pad_token_id=0,
    )
    Qwen2ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out)
    gen = {"eos_token_id": 0, "bos_token_id": 0, "pad_token_id": 0}
    (out / "generation_config.json").write_text(json.dumps(gen))
    return out


if __name__ == "__main__":
    print(build(Path(sys.argv[1])))
