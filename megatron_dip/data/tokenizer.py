"""Tokenizers: which one a run uses (`TokenizerSpec`, `load_tokenizer`), and the tiny byte tokenizer.

`--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR` (Megatron-LM's flags) loads a local
Hugging Face tokenizer (`hf_tokenizer.HuggingFaceTokenizer`); without them the run uses the
`ByteTokenizer` below, the default of the tiny presets. Both answer the `Tokenizer` protocol:
vocabulary size, special ids (pad, eos, bos, and the placeholder of each media role: "image",
"audio") and encoding. The model's pad and placeholder ids are taken from the run's tokenizer
(`training.config.validate`), never from global constants.

The byte tokenizer is a tiny, deterministic, offline tokenizer: printable ASCII characters plus a
lossless byte escape. It exists so that the readers, tests and the CPU quick start need no
download. It is not a language-modelling tokenizer; it only has to be exact, reversible and
small enough for the tiny models' vocabulary of 128.

Id layout (`ByteTokenizer.vocab_size` = 118):

* 0 `PAD_TOKEN`, 1 `IMAGE_TOKEN` (both from `sample.py`, reserved in every tokenizer we build),
  2 BOS, 3 EOS;
* 4 BYTE: escape, followed by two nibble tokens (high, low) spelling one raw UTF-8 byte; used for
  every byte that has no own id (non-ASCII text, control characters), so decoding is lossless;
* 5..20 the 16 nibbles;
* 21 newline, 22 tab, 23..117 the printable ASCII characters 0x20..0x7E in order.

One character costs one token (three for escaped bytes), so sequences are longer than with a
learned vocabulary; that is fine for tiny models and keeps the mapping obvious.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from megatron_dip.data.sample import IMAGE_TOKEN, PAD_TOKEN

from .hf_tokenizer import HF_TOKENIZER, HuggingFaceTokenizer

BYTE_TOKENIZER = "ByteTokenizer"
TOKENIZER_TYPES = (BYTE_TOKENIZER, HF_TOKENIZER)

BOS_TOKEN = 2
EOS_TOKEN = 3
BYTE_TOKEN = 4
_NIBBLE0 = 5
_NEWLINE = 21
_TAB = 22
_PRINTABLE0 = 23
_FIRST_PRINTABLE, _LAST_PRINTABLE = 0x20, 0x7E

assert (PAD_TOKEN, IMAGE_TOKEN) == (0, 1), "the id layout below assumes PAD=0, IMAGE=1"


def _byte_table() -> np.ndarray:
    """Id of each byte value that has its own token, -1 for bytes that need the escape."""
    table = np.full(256, -1, dtype=np.int64)
    table[ord("\n")] = _NEWLINE
    table[ord("\t")] = _TAB
    printable = np.arange(_FIRST_PRINTABLE, _LAST_PRINTABLE + 1)
    table[printable] = _PRINTABLE0 + printable - _FIRST_PRINTABLE
    return table


class ByteTokenizer:
    """Character-level tokenizer for ASCII with a lossless escape for all other bytes.

    Stateless apart from two lookup tables; instances are interchangeable.
    """

    vocab_size: int = _PRINTABLE0 + (_LAST_PRINTABLE - _FIRST_PRINTABLE + 1)
    pad_id: int = PAD_TOKEN
    image_id: int = IMAGE_TOKEN
    bos_id: int = BOS_TOKEN
    eos_id: int = EOS_TOKEN

    name: str = BYTE_TOKENIZER

    def __init__(self) -> None:
        self._to_id = _byte_table()
        self._to_byte = np.full(self.vocab_size, -1, dtype=np.int64)
        own = np.flatnonzero(self._to_id >= 0)
        self._to_byte[self._to_id[own]] = own

    def special_id(self, role: str) -> int | None:
        """The id of a special role: "pad", "eos", "bos", "image"; None for others (the tiny
        presets give other placeholders ids of their own)."""
        return {
            "pad": self.pad_id,
            "eos": self.eos_id,
            "bos": self.bos_id,
            "image": self.image_id,
        }.get(role)

    def encode(self, text: str) -> np.ndarray:
        """Token ids (int64) of `text`; no BOS/EOS are added."""
        raw = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)
        ids = self._to_id[raw]
        if (ids >= 0).all():
            return ids
        # Escaped bytes become three tokens; build the output by per-byte token counts.
        counts = np.where(ids >= 0, 1, 3)
        out = np.empty(int(counts.sum()), dtype=np.int64)
        starts = np.cumsum(counts) - counts
        own = ids >= 0
        out[starts[own]] = ids[own]
        esc = starts[~own]
        out[esc] = BYTE_TOKEN
        out[esc + 1] = _NIBBLE0 + (raw[~own] >> 4)
        out[esc + 2] = _NIBBLE0 + (raw[~own] & 0xF)
        return out

    def decode(self, ids: np.ndarray | list[int]) -> str:
        """Text of `ids`; PAD, IMAGE, BOS and EOS are dropped, escapes are resolved.

        Raises ValueError on an id outside the vocabulary or a broken escape sequence.
        """
        out = bytearray()
        seq = [int(i) for i in ids]
        j = 0
        while j < len(seq):
            tok = seq[j]
            if not 0 <= tok < self.vocab_size:
                raise ValueError(f"token id {tok} at position {j} is outside the vocabulary")
            if tok == BYTE_TOKEN:
                nibbles = seq[j + 1 : j + 3]
                if len(nibbles) != 2 or not all(0 <= n - _NIBBLE0 < 16 for n in nibbles):
                    raise ValueError(f"broken byte escape at position {j}")
                out.append(((nibbles[0] - _NIBBLE0) << 4) | (nibbles[1] - _NIBBLE0))
                j += 3
                continue
            if self._to_byte[tok] >= 0:
                out.append(int(self._to_byte[tok]))
            elif tok not in (PAD_TOKEN, IMAGE_TOKEN, BOS_TOKEN, EOS_TOKEN):
                raise ValueError(f"nibble token {tok} at position {j} outside a byte escape")
            j += 1
        return out.decode("utf-8", errors="replace")


class Tokenizer(Protocol):
    """What the readers and the run's validation need of a tokenizer."""

    name: str
    vocab_size: int  # every id the tokenizer can produce is below it
    pad_id: int
    eos_id: int
    bos_id: int | None

    def special_id(self, role: str) -> int | None:
        """Id of a role ("pad", "eos", "bos", "image", "audio"); None if the tokenizer has none."""
        ...

    def encode(self, text: str) -> np.ndarray:
        """Token ids (int64) of `text`, no special tokens added."""
        ...

    def decode(self, ids) -> str:
        """Text of `ids`."""
        ...


@dataclass(frozen=True)
class TokenizerSpec:
    """Which tokenizer a run uses (hashable, picklable: every process loads its own copy).

    `special`: (role, token) pairs overriding the tokenizer's choice of special tokens
    (`--dip-special-tokens image=<|image_pad|>,pad=<|endoftext|>`); `prompt_format`: how
    conversations become text (`chat.PROMPT_FORMATS`; None: the tokenizer's default).
    """

    type: str = BYTE_TOKENIZER
    model: str | None = None
    special: tuple[tuple[str, str], ...] = ()
    prompt_format: str | None = None

    def __post_init__(self) -> None:
        if self.type not in TOKENIZER_TYPES:
            raise ValueError(
                f"--tokenizer-type: choose {' or '.join(TOKENIZER_TYPES)}, got {self.type!r}"
            )
        if (self.type == HF_TOKENIZER) != (self.model is not None):
            raise ValueError(
                "--tokenizer-model: a directory with tokenizer.json / tokenizer_config.json is "
                f"needed with --tokenizer-type {HF_TOKENIZER}, and only with it"
            )
        if self.special and self.type != HF_TOKENIZER:
            raise ValueError(f"--dip-special-tokens needs --tokenizer-type {HF_TOKENIZER}")


@functools.lru_cache(maxsize=8)
def load_tokenizer(spec: TokenizerSpec) -> Tokenizer:
    """The tokenizer of `spec`, loaded once per process (a Hugging Face one from its local
    directory, offline)."""
    if spec.type == BYTE_TOKENIZER:
        return ByteTokenizer()
    return HuggingFaceTokenizer(spec.model, special=dict(spec.special))


def padded_vocab_size(size: int, *, divisible_by: int, tensor_parallel: int) -> int:
    """Megatron-LM's `_vocab_size_with_padding`: `size` rounded up to a multiple of
    `divisible_by` x `tensor_parallel` (so every tensor-parallel shard of the embedding is
    equal and aligned)."""
    if size < 1 or divisible_by < 1 or tensor_parallel < 1:
        raise ValueError(f"sizes must be positive: {size}, {divisible_by}, {tensor_parallel}")
    multiple = divisible_by * tensor_parallel
    return int(math.ceil(size / multiple)) * multiple
