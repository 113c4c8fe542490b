"""The benchmark's shared inputs, built offline and saved once under benchmarks/.cache/: a 4,096-token BPE tokenizer
trained on generated text, a Llama-shaped policy (4 layers, hidden 256, 4 heads, intermediate 1024) and a reward
model of the same shape (also the PPO value model), 512 prompts, and 2,048 stepwise PRM rows of 3-4 steps.

    python benchmarks/artifacts.py          # prints the folder
"""

import json
import random
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, LlamaConfig, PreTrainedTokenizerFast

CACHE = Path(__file__).resolve().parent / ".cache"
WORDS = "the a of to in and is was for on with as by at from his her they one two three number sum step answer " \
        "first then next so add plus equals result check correct wrong total value count left right".split()


def pseudo_word(rng: random.Random) -> str:
    return "".join(rng.choice("bcdfghklmnprstvz") + rng.choice("aeiou") for _ in range(rng.randint(1, 4)))


def corpus(rng: random.Random, n: int) -> list[str]:
    """Generated lines of words, pseudo-words and arithmetic for training the BPE tokenizer."""
    lines = []
    for _ in range(n):
        a, b = rng.randrange(1000), rng.randrange(1000)
        words = " ".join(rng.choice(WORDS) if rng.random() < 0.5 else pseudo_word(rng)
                         for _ in range(rng.randint(3, 12)))
        lines.append(f"{words} {a}+{b}={a + b} {rng.choice(WORDS)}{rng.randrange(100)}")
    return lines


def build(folder: Path = CACHE) -> Path:
    """Write the artifacts (once) and return their folder."""
    if (folder / "done").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=4096, special_tokens=["<pad>", "<bos>", "<eos>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(rng, 50_000), trainer)
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                        unk_token="<unk>", padding_side="left")
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2, num_labels=1)
    torch.manual_seed(0)
    for name, cls in [("policy", AutoModelForCausalLM), ("reward", AutoModelForSequenceClassification)]:
        cls.from_config(config).save_pretrained(folder / name)
        tokenizer.save_pretrained(folder / name)
    with (folder / "prompts.jsonl").open("w") as f:
        for line in corpus(rng, 512):
            f.write(json.dumps({"prompt": line[:24]}) + "\n")
    with (folder / "prm.jsonl").open("w") as f:
        for _ in range(2048):
            nums = [rng.randrange(20) for _ in range(rng.randint(4, 5))]
            wrong_at = rng.randrange(len(nums) - 1) if rng.random() < 0.5 else len(nums)
            steps, total = [], nums[0]
            for i, x in enumerate(nums[1:]):
                before, total = total, total + x + (rng.randint(1, 3) if i == wrong_at else 0)
                steps.append(f"{words_before(rng)} {before}+{x}={total}")
            f.write(json.dumps({"prompt": "+".join(map(str, nums)) + "=", "completions": steps,
                                "labels": [i < wrong_at for i in range(len(steps))]}) + "\n")
    (folder / "done").write_text("ok\n")
    return folder


def words_before(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 6)))


if __name__ == "__main__":
    print(build(Path(sys.argv[1]) if len(sys.argv) > 1 else CACHE))
