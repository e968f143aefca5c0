"""A local Hugging Face tokenizer behind the `tokenizer.Tokenizer` protocol (offline).

`--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR` loads `DIR` (tokenizer.json,
tokenizer_config.json, optionally chat_template.jinja) with `transformers.AutoTokenizer`, never
from the network. transformers and tokenizers are optional (`pip install "megatron-dip[hf]"`) and
imported only here, when such a run starts.

Special ids come from the tokenizer: pad (its pad token, else its EOS), eos, bos (may be absent),
and one placeholder token per media role, the first of `PLACEHOLDER_CANDIDATES[role]` that the
vocabulary holds as one atomic token (Qwen2-VL's `<|image_pad|>`, LLaVA's `<image>`, ...).
`--dip-special-tokens role=TOKEN,...` names them explicitly; a named token must exist and
tokenize to exactly one id. When the vocabulary has `<|vision_start|>` and `<|vision_end|>`
(Qwen2-VL), an image is written as start, placeholders, end (`image_text`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

HF_TOKENIZER = "HuggingFaceTokenizer"  # its --tokenizer-type

logger = logging.getLogger(__name__)

PLACEHOLDER_CANDIDATES: dict[str, tuple[str, ...]] = {
    "image": ("<|image_pad|>", "<image>", "<|image|>", "<IMG_CONTEXT>"),
    "audio": ("<|audio_pad|>", "<|AUDIO|>", "<audio>"),
}
ROLES = ("pad", "eos", "bos", *PLACEHOLDER_CANDIDATES)
VISION_WRAP = ("<|vision_start|>", "<|vision_end|>")
INSTALL_HINT = (
    f"--tokenizer-type {HF_TOKENIZER} needs the transformers and tokenizers packages: "
    'pip install "megatron-dip[hf]" (or: pip install transformers tokenizers)'
)


def import_auto_tokenizer():
    """`transformers.AutoTokenizer`, or ImportError naming the flag and the pip command."""
    try:
        from transformers import AutoTokenizer
    except ImportError as err:
        raise ImportError(f"{INSTALL_HINT} ({err})") from err
    return AutoTokenizer


class HuggingFaceTokenizer:
    """A fast Hugging Face tokenizer from a local directory (module docstring)."""

    name: str = HF_TOKENIZER

    def __init__(self, path: str | Path, *, special: Mapping[str, str] | None = None) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise ValueError(f"--tokenizer-model: {self.path} is not a directory")
        unknown = sorted(set(special or {}) - set(ROLES))
        if unknown:
            raise ValueError(f"--dip-special-tokens: unknown roles {unknown}; known: {ROLES}")
        auto = import_auto_tokenizer()
        try:
            self._tok = auto.from_pretrained(str(self.path), local_files_only=True)
        except (OSError, ValueError) as err:
            raise ValueError(
                f"--tokenizer-model: cannot load a tokenizer from {path}: {err}"
            ) from None
        if not getattr(self._tok, "is_fast", False):
            raise ValueError(
                f"--tokenizer-model: {path} holds a slow tokenizer; a fast one (tokenizer.json) "
                "is needed for character offsets"
            )
        self.vocab_size = len(self._tok)
        self._vocab = self._tok.get_vocab()
        self._ids = self._special_ids(dict(special or {}))
        if self._ids["eos"] is None:
            raise ValueError(
                f"--tokenizer-model: the tokenizer at {path} has no EOS token; name one with "
                "--dip-special-tokens eos=TOKEN"
            )
        if self._ids["pad"] is None:
            self._ids["pad"] = self._ids["eos"]  # padding carries no loss: any id will do
        self.pad_id: int = self._ids["pad"]
        self.eos_id: int = self._ids["eos"]
        self.bos_id: int | None = self._ids["bos"]

    # -- special tokens -------------------------------------------------------------------

    def _atomic_id(self, token: str) -> int | None:
        """The id of `token` if the vocabulary holds it as one token that text maps to."""
        if token not in self._vocab:
            return None
        ids = self._tok.encode(token, add_special_tokens=False)
        return int(ids[0]) if len(ids) == 1 else None

    def _special_ids(self, named: dict[str, str]) -> dict[str, int | None]:
        found: dict[str, int | None] = {}
        for role in ROLES:
            if role in named:
                token = named[role]
                found[role] = self._atomic_id(token)
                if found[role] is None:
                    raise ValueError(
                        f"--dip-special-tokens: {role}={token!r} is not one token of the "
                        f"tokenizer at {self.path}"
                    )
                continue
            own = (
                getattr(self._tok, f"{role}_token_id", None)
                if role in ("pad", "eos", "bos")
                else None
            )
            if own is not None:
                found[role] = int(own)
                continue
            candidates = PLACEHOLDER_CANDIDATES.get(role, ())
            found[role] = next(
                (i for t in candidates if (i := self._atomic_id(t)) is not None), None
            )
        return found

    def special_id(self, role: str) -> int | None:
        """Id of a role ("pad", "eos", "bos", "image", "audio"); None if there is none."""
        return self._ids.get(role)

    def token_text(self, token_id: int) -> str:
        """The text form of one (special) token."""
        return str(self._tok.convert_ids_to_tokens(int(token_id)))

    def image_text(self) -> str:
        """How one image is written in a prompt before its placeholder run is expanded: the
        image token, wrapped in <|vision_start|> / <|vision_end|> when the vocabulary has them."""
        image = self.special_id("image")
        if image is None:
            raise ValueError(
                f"the tokenizer at {self.path} has no image placeholder token (looked for "
                f"{', '.join(PLACEHOLDER_CANDIDATES['image'])}); name one with "
                "--dip-special-tokens image=TOKEN"
            )
        text = self.token_text(image)
        if all(self._atomic_id(t) is not None for t in VISION_WRAP):
            return VISION_WRAP[0] + text + VISION_WRAP[1]
        return text

    def text_of(self, role: str) -> str:
        """The text form of a special role's token ("" when the tokenizer has none)."""
        token = self.special_id(role)
        return "" if token is None else self.token_text(token)

    def has_tokens(self, tokens: Sequence[str]) -> list[str]:
        """Those of `tokens` that are NOT single tokens of the vocabulary."""
        return [t for t in tokens if self._atomic_id(t) is None]

    # -- text -----------------------------------------------------------------------------

    def encode(self, text: str) -> np.ndarray:
        """Token ids (int64) of `text`; special-token text maps to its id, nothing is added."""
        return np.asarray(self._tok.encode(text, add_special_tokens=False), dtype=np.int64)

    def encode_with_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """(ids int64 [n], character offsets int64 [n, 2]) of `text`, nothing added."""
        enc = self._tok.backend_tokenizer.encode(text, add_special_tokens=False)  # the Rust one
        ids = np.asarray(enc.ids, dtype=np.int64)
        offsets = np.asarray(enc.offsets, dtype=np.int64).reshape(len(ids), 2)
        return ids, offsets

    def decode(self, ids) -> str:
        """Text of `ids` (special tokens kept)."""
        return self._tok.decode([int(i) for i in ids])

    # -- chat -----------------------------------------------------------------------------

    @property
    def chat_template(self) -> str | None:
        """The tokenizer's own Jinja chat template (None if it has none)."""
        template = getattr(self._tok, "chat_template", None)
        return template if isinstance(template, str) and template else None

    def render_chat(
        self, messages: list[dict[str, Any]], *, template: str | None, add_generation_prompt: bool
    ) -> str:
        """`apply_chat_template(messages, tokenize=False)` with `template` (None: the
        tokenizer's own)."""
        return self._tok.apply_chat_template(
            messages,
            chat_template=template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )
