"""Small tokenizers built in-test (no downloads): byte-level BPE tokenizer.json files in the style of Llama-3
(BOS <|begin_of_text|>, EOS <|end_of_text|>, BOS added by the post-processor) and Qwen (no BOS, EOS and pad
<|endoftext|>), trained with the `tokenizers` library on a small corpus, with their tokenizer_config.json."""

from __future__ import annotations

import json
from pathlib import Path

STYLES = {
    "llama3": dict(specials=["<|begin_of_text|>", "<|end_of_text|>"], bos="<|begin_of_text|>", eos="<|end_of_text|>",
                   pad=None, tokenizer_class="PreTrainedTokenizerFast"),
    "qwen": dict(specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], bos=None, eos="<|endoftext|>",
                 pad="<|endoftext|>", tokenizer_class="Qwen2Tokenizer"),
}


def corpus_lines(n: int = 400) -> list[str]:
    """The passkey prompt's texts (so its prompts tokenize compactly) and word salad with numbers."""
    from tapetrain.eval.passkey import FILLER, QUESTION, TASK, key_line

    words = ("the grass is green sky blue sun yellow here we go there and back again pass key remember it "
             "what is number digits 0123456789 tokens model train long context").split()
    salad = [" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(8 + i % 9)) + f" {i * 37 % 1000}."
             for i in range(n)]
    return [TASK, FILLER, QUESTION] * 20 + [key_line(i * 7919 % 50000 + 1) for i in range(100)] + salad


def write_bpe_tokenizer(directory: str | Path, style: str = "llama3", vocab_size: int = 400) -> Path:
    """`directory`/tokenizer.json + tokenizer_config.json of a byte-level BPE in `style`; returns tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    spec = STYLES[style]
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=spec["specials"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus_lines(), trainer=trainer)
    if spec["bos"]:  # Llama-3: the post-processor adds BOS when special tokens are requested
        bos = spec["bos"]
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, tok.token_to_id(bos))])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    path = directory / "tokenizer.json"
    tok.save(str(path))
    config = {"tokenizer_class": spec["tokenizer_class"], "bos_token": spec["bos"], "eos_token": spec["eos"],
              "pad_token": spec["pad"], "model_max_length": 4096, "clean_up_tokenization_spaces": False}
    if style == "qwen":
        config.update(add_bos_token=False, add_prefix_space=False, errors="replace", split_special_tokens=False)
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return path
