"""A small Hugging Face tokenizer trained on the spot (never downloaded), for tests and the quick start.

A byte-level BPE (GPT-2 / Llama 3 / Qwen2 style: ids 0 and 1 are the bytes "!" and '"', as in
those vocabularies) trained with the `tokenizers` library on the given texts in well under a
second, plus the special tokens of ChatML, Llama 3's headers and Qwen2-VL's image tokens, and a
ChatML chat template in `tokenizer_config.json`. Saved with `transformers` as a directory that
`--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR` loads offline.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from .hf_tokenizer import INSTALL_HINT

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
)
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tiny_tokenizer(
    directory: str | Path, texts: Iterable[str], *, vocab_size: int = 400
) -> Path:
    """Train the tokenizer on `texts` and save it into `directory`; returns the directory."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        from transformers import PreTrainedTokenizerFast
    except ImportError as err:
        raise ImportError(f"{INSTALL_HINT} ({err})") from err
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(list(texts), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=list(SPECIAL_TOKENS[1:]),
    )
    fast.chat_template = CHAT_TEMPLATE
    out = Path(directory)
    fast.save_pretrained(str(out))
    return out
