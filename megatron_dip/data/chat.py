"""Conversations and documents -> token ids and loss masks, in the run's prompt format.

A record's text is a tuple of `Turn`s: roles "system", "user", "assistant" (a conversation), or
one "document" turn (interleaved image-text pretraining data: loss on all of its text). "<image>"
in a turn's text stands for the next image of the record.

`--tokenizer-prompt-format` (Megatron-LM's flag) chooses how turns become text:

* `plain` — LLaVA-Pretrain's layout: BOS, each turn's text, a user/system turn ended by a newline,
  an assistant turn by EOS. The byte tokenizer's only format (it has no chat tokens).
* `hf` — the tokenizer's own `chat_template`, rendered exactly as transformers'
  `apply_chat_template` renders it (the default when the tokenizer has one).
* `llama3`, `chatml`, `qwen2` — named formats (Jinja templates of ours, rendered the same way):
  Llama 3's header/eot tokens; ChatML's `<|im_start|>`/`<|im_end|>`; ChatML with Qwen2's default
  system prompt. The tokenizer must have their special tokens.

Loss only on assistant turns: an assistant turn's loss covers its text and the template's end of
turn (trailing whitespace excluded), found by rendering the conversation's prefixes (the text
before turn k with the generation prompt, the text up to turn k): a template whose renderings of
prefixes are not prefixes of the whole is refused. The whole text is tokenized at once, as
`apply_chat_template(tokenize=True)` does, and a token is a loss token when it starts inside an
assistant span. Each image becomes the tokenizer's image text (`HuggingFaceTokenizer.image_text`),
whose placeholder token is then expanded into a run as long as the image's LLM tokens;
placeholders never carry loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from .records import BadSampleError
from .tokenizer import ByteTokenizer, Tokenizer

IMAGE_TAG = "<image>"
ROLES = ("system", "user", "assistant")
DOCUMENT = "document"
PROMPT_FORMATS = ("plain", "hf", "llama3", "chatml", "qwen2")
_LLAVA_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
_LLAVA_ROLES["system"] = "system"

_CHATML_BODY = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
NAMED_TEMPLATES = {
    "llama3": (
        "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
        "<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
    ),
    "chatml": _CHATML_BODY,
    "qwen2": (
        "{% if not messages or messages[0]['role'] != 'system' %}<|im_start|>system\n"
        "You are a helpful assistant.<|im_end|>\n{% endif %}" + _CHATML_BODY
    ),
}
TEMPLATE_TOKENS = {
    "llama3": ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
    "chatml": ("<|im_start|>", "<|im_end|>"),
    "qwen2": ("<|im_start|>", "<|im_end|>"),
}


@dataclass(frozen=True)
class Turn:
    """One turn: role ("system", "user", "assistant" or "document") and text."""

    role: str
    content: str


def llava_turns(conversations: Any) -> tuple[Turn, ...]:
    """The turns of a LLaVA "conversations" list ({"from": "human"|"gpt", "value": ...}; the
    OpenAI-style {"role", "content"} is accepted too). BadSampleError when malformed."""
    if not isinstance(conversations, list) or not conversations:
        raise BadSampleError("'conversations' must be a non-empty list")
    turns = []
    for t, raw in enumerate(conversations):
        turn = raw if isinstance(raw, dict) else {}
        role = _LLAVA_ROLES.get(turn.get("from", turn.get("role")))
        value = turn.get("value", turn.get("content"))
        if role is None or not isinstance(value, str):
            raise BadSampleError(
                f"turn {t} needs 'from' in {sorted(_LLAVA_ROLES)} and a string 'value'"
            )
        turns.append(Turn(role, value))
    return tuple(turns)


class ConversationEncoder(Protocol):
    """Turns (with "<image>" tags) -> (token ids int64, labels_mask uint8)."""

    def encode(
        self, turns: Sequence[Turn], *, image_tokens: Sequence[int]
    ) -> tuple[np.ndarray, np.ndarray]:
        """Ids and mask; image i becomes `image_tokens[i]` placeholders. BadSampleError when
        the "<image>" tags do not match the images."""
        ...


def make_encoder(
    tokenizer: Tokenizer, prompt_format: str | None, *, image_id: int | None
) -> ConversationEncoder:
    """The encoder of `prompt_format` (None: the tokenizer's default, see the module docstring);
    ValueError naming --tokenizer-prompt-format when the tokenizer cannot write it."""
    if isinstance(tokenizer, ByteTokenizer):
        if prompt_format not in (None, "plain"):
            raise ValueError(
                f"--tokenizer-prompt-format {prompt_format}: the byte tokenizer has no chat "
                "tokens; use plain, or --tokenizer-type HuggingFaceTokenizer"
            )
        return ByteEncoder(tokenizer, image_id=tokenizer.image_id if image_id is None else image_id)
    return TemplateEncoder(tokenizer, prompt_format, image_id=image_id)


def _check_tags(turns: Sequence[Turn], images: int) -> None:
    tags = sum(t.content.count(IMAGE_TAG) for t in turns)
    if tags != images:
        raise BadSampleError(f"{tags} {IMAGE_TAG} tags for {images} images")


class ByteEncoder:
    """The `plain` format on the byte tokenizer, built from ids (no text form of BOS/EOS)."""

    def __init__(self, tokenizer: ByteTokenizer, *, image_id: int) -> None:
        self.tokenizer, self.image_id = tokenizer, image_id

    def encode(
        self, turns: Sequence[Turn], *, image_tokens: Sequence[int]
    ) -> tuple[np.ndarray, np.ndarray]:
        _check_tags(turns, len(image_tokens))
        tok = self.tokenizer
        ids: list[np.ndarray] = [np.array([tok.bos_id])]
        mask: list[np.ndarray] = [np.zeros(1, dtype=np.uint8)]
        image = 0
        for turn in turns:
            loss = 1 if turn.role in ("assistant", DOCUMENT) else 0
            for j, part in enumerate(turn.content.split(IMAGE_TAG)):
                if j:
                    ids.append(np.full(image_tokens[image], self.image_id, dtype=np.int64))
                    mask.append(np.zeros(image_tokens[image], dtype=np.uint8))
                    image += 1
                enc = tok.encode(part)
                ids.append(enc)
                mask.append(np.full(enc.size, loss, dtype=np.uint8))
            end = tok.eos_id if loss else tok.encode("\n")[0]
            ids.append(np.array([end]))
            mask.append(np.array([loss], dtype=np.uint8))
        return np.concatenate(ids).astype(np.int64), np.concatenate(mask)


class TemplateEncoder:
    """A Hugging Face tokenizer's prompt formats (module docstring)."""

    def __init__(self, tokenizer, prompt_format: str | None, *, image_id: int | None) -> None:
        if prompt_format is None:
            prompt_format = "hf" if tokenizer.chat_template is not None else "plain"
        if prompt_format not in PROMPT_FORMATS:
            raise ValueError(
                f"--tokenizer-prompt-format: choose one of {', '.join(PROMPT_FORMATS)}, got "
                f"{prompt_format!r}"
            )
        if prompt_format == "hf" and tokenizer.chat_template is None:
            raise ValueError(
                f"--tokenizer-prompt-format hf: the tokenizer at {tokenizer.path} has no "
                "chat_template; choose plain, llama3, chatml or qwen2"
            )
        missing = tokenizer.has_tokens(TEMPLATE_TOKENS.get(prompt_format, ()))
        if missing:
            raise ValueError(
                f"--tokenizer-prompt-format {prompt_format}: the tokenizer at {tokenizer.path} "
                f"lacks the special tokens {missing}"
            )
        self.tokenizer, self.format, self.image_id = tokenizer, prompt_format, image_id
        self.template = NAMED_TEMPLATES.get(prompt_format)  # None: the tokenizer's own
        self._image_text = tokenizer.image_text() if image_id is not None else None

    def render(self, turns: Sequence[Turn]) -> tuple[str, list[tuple[int, int]]]:
        """The prompt text of `turns` (images still as "<image>") and its loss spans
        (character ranges)."""
        if len(turns) == 1 and turns[0].role == DOCUMENT:
            return self._render_plain(turns)
        if any(t.role not in ROLES for t in turns):
            raise BadSampleError(f"turn roles must be in {ROLES}, got {[t.role for t in turns]}")
        if self.format == "plain":
            return self._render_plain(turns)
        full = self._chat(turns, generation=False)
        spans = []
        for k, turn in enumerate(turns):
            if turn.role != "assistant":
                continue
            head = self._chat(turns[:k], generation=True)
            upto = self._chat(turns[: k + 1], generation=False)
            if not (full.startswith(head) and full.startswith(upto) and len(head) <= len(upto)):
                raise ValueError(
                    f"--tokenizer-prompt-format {self.format}: the chat template does not render "
                    "a conversation's prefixes as prefixes of the whole, so the assistant turns "
                    "cannot be located for the loss mask"
                )
            spans.append((len(head), len(upto.rstrip())))
        return full, spans

    def _chat(self, turns: Sequence[Turn], *, generation: bool) -> str:
        messages = [{"role": t.role, "content": t.content} for t in turns]
        return self.tokenizer.render_chat(
            messages, template=self.template, add_generation_prompt=generation
        )

    def _render_plain(self, turns: Sequence[Turn]) -> tuple[str, list[tuple[int, int]]]:
        tok = self.tokenizer
        text, spans = tok.text_of("bos"), []
        for turn in turns:
            if turn.role in ("assistant", DOCUMENT):
                start = len(text)
                text += turn.content + tok.text_of("eos")
                spans.append((start, len(text)))
            else:
                text += turn.content + "\n"
        return text, spans

    def encode(
        self, turns: Sequence[Turn], *, image_tokens: Sequence[int]
    ) -> tuple[np.ndarray, np.ndarray]:
        _check_tags(turns, len(image_tokens))
        if image_tokens and self._image_text is None:
            raise BadSampleError("a record with images for a model without an image module")
        if self._image_text is not None:
            turns = [Turn(t.role, t.content.replace(IMAGE_TAG, self._image_text)) for t in turns]
        text, spans = self.render(turns)
        ids, offsets = self.tokenizer.encode_with_offsets(text)
        starts = offsets[:, 0]
        loss = np.zeros(len(ids), dtype=bool)
        for lo, hi in spans:
            loss |= (starts >= lo) & (starts < hi)
        is_image = ids == self.image_id if self.image_id is not None else np.zeros_like(loss)
        if int(is_image.sum()) != len(image_tokens):
            raise BadSampleError(
                f"{int(is_image.sum())} image placeholder tokens after tokenizing for "
                f"{len(image_tokens)} images (does the text contain the placeholder token itself?)"
            )
        repeat = np.ones(len(ids), dtype=np.int64)
        repeat[is_image] = np.asarray(image_tokens, dtype=np.int64)
        mask = (loss & ~is_image).astype(np.uint8)
        return np.repeat(ids, repeat), np.repeat(mask, repeat)


def fit_tokens(
    ids: np.ndarray, mask: np.ndarray, *, max_tokens: int, placeholders: Sequence[int]
) -> tuple[np.ndarray, np.ndarray]:
    """`ids`/`mask` cut to `max_tokens` (the text is truncated, every image kept).

    BadSampleError when that would cut an image's placeholders (the sample must be skipped) or
    leave no loss token.
    """
    if len(ids) <= max_tokens:
        return ids, mask
    tail = np.isin(ids[max_tokens:], list(placeholders))
    if tail.any():
        first = max_tokens + int(np.flatnonzero(tail)[0])
        raise BadSampleError(
            f"{len(ids)} tokens; truncating to {max_tokens} would cut the image placeholders "
            f"starting at token {first}"
        )
    if not mask[1:max_tokens].any():
        raise BadSampleError(f"{len(ids)} tokens; truncated to {max_tokens} no loss token is left")
    return ids[:max_tokens], mask[:max_tokens]
