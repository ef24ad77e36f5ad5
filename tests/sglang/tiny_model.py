"""TEST SCAFFOLDING: build a tiny random-weight Qwen2 model + byte-level BPE tokenizer.

Run with the SGLang venv's python (it has torch, transformers, tokenizers); the script puts
the CPU shim (shim/) and this checkout on its own path, so nothing else is needed:

    ~/.cache/mori/sglang-<version>/bin/python tests/sglang/tiny_model.py OUT_DIR [--context N]

Deterministic (fixed seed), ~0.3 MB, built in a few seconds. The same model serves the engine
tests and live replays (`mori replay` against `mori-sglang --model-path OUT_DIR`): its
tokenizer is trained on the replay's own prompt words (router.replay.prompts), so a replayed
prompt of N nominal tokens is about N real ones, and its context (default 40960 tokens) holds
the longest step of traces/generated-claude-code-32k.jsonl. A byte-level BPE is required:
with transformers 5 a WordLevel tokenizer encodes everything to [] and crashes the scheduler.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
CONTEXT_TOKENS = 40960
VOCAB = 512
HIDDEN, LAYERS = 64, 2  # the test model; bench/real_engine_ab.py widens it to make a miss cost
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def training_text() -> list[str]:
    """What the tokenizer learns from: replay prompts (word salad, chat markup) and the
    short phrases the engine tests send."""
    from router.replay.prompts import filler

    rng = random.Random(0)
    replay = [f"<user>{filler(rng, 400)}\n<assistant>{filler(rng, 80)}\n" for _ in range(300)]
    phrases = [f"program {i} step {j} tool call result ok" for i in range(50) for j in range(5)]
    return replay + phrases


def build(
    out: Path, context: int = CONTEXT_TOKENS, hidden: int = HIDDEN, layers: int = LAYERS
) -> Path:
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
        vocab_size=VOCAB,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(training_text(), trainer)
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
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context,
        tie_word_embeddings=True,
        eos_token_id=0,
        bos_token_id=0,
        pad_token_id=0,
    )
    Qwen2ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out)
    gen = {"eos_token_id": 0, "bos_token_id": 0, "pad_token_id": 0}
    (out / "generation_config.json").write_text(json.dumps(gen))
    return out


def _load_cpu_shim() -> None:
    """The shim's torchvision op declaration: transformers imports torchvision, whose PyPI
    build needs CUDA torch (tests/sglang/shim/sitecustomize.py)."""
    sys.path[:0] = [str(HERE / "shim"), str(REPO)]
    spec = importlib.util.spec_from_file_location("mori_cpu_shim", HERE / "shim/sitecustomize.py")
    assert spec is not None and spec.loader is not None
    spec.loader.exec_module(importlib.util.module_from_spec(spec))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="model directory to write")
    parser.add_argument("--context", type=int, default=CONTEXT_TOKENS, help="context tokens")
    parser.add_argument("--hidden", type=int, default=HIDDEN, help="hidden size (4 heads)")
    parser.add_argument("--layers", type=int, default=LAYERS, help="decoder layers")
    args = parser.parse_args()
    _load_cpu_shim()
    print(build(args.out, args.context, args.hidden, args.layers))
