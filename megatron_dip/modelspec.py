"""Shapes of multimodal models: the vocabulary shared by the planner, the models and the tools.

Pure data, no torch: the planner sizes and costs modules from these specs, `megatron_dip.models`
builds Megatron-Core layers from the same specs, so a preset means the same shapes everywhere.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class ModuleKind(str, enum.Enum):
    """The modality modules DIP knows how to place, cost and build."""

    VIT = "vit"  # vision encoder: patch embedding, encoder layers, projector into the LLM
    LLM = "llm"  # decoder-only language model with output head and loss
    TEXT_ENCODER = "text_encoder"  # an LLM without head; conditions a DiT
    DIT = "dit"  # diffusion transformer: adaLN, self- and cross-attention, diffusion loss


@dataclass(frozen=True)
class LayerShape:
    """One transformer layer: hidden size, FFN size, attention heads and key/value groups."""

    hidden: int
    ffn: int
    heads: int
    kv_groups: int
    gated_mlp: bool = False  # SwiGLU (LLMs) vs. GELU (ViT, DiT)

    def __post_init__(self) -> None:
        if min(self.hidden, self.ffn, self.heads, self.kv_groups) <= 0:
            raise ValueError(f"layer sizes must be positive: {self}")
        if self.hidden % self.heads or self.heads % self.kv_groups:
            raise ValueError(
                f"hidden {self.hidden} must divide into {self.heads} heads and the heads into "
                f"{self.kv_groups} key/value groups"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


@dataclass(frozen=True)
class ModuleSpec:
    """One modality module of a multimodal model.

    `feeds` names the module that consumes this one's output: a ViT feeds the LLM (its projected
    embeddings replace the image placeholder tokens), a text encoder feeds the DiT (every DiT
    layer cross-attends to it). The module that feeds nobody computes the loss.
    """

    name: str
    kind: ModuleKind
    num_layers: int
    layer: LayerShape
    trainable: bool = True
    feeds: str | None = None
    vocab_size: int = 0  # llm, text_encoder
    patch_size: int = 14  # vit: pixels per patch side; dit: latent patch side
    in_channels: int = 3  # vit: image channels; dit: latent channels
    merge: int = 4  # vit: patches merged per side into one LLM token (52x52 -> 13x13 = 169)
    out_hidden: int = 0  # vit: projector output (the LLM hidden); dit: 0
    cond_hidden: int = 0  # dit: hidden size of the conditioning text encoding

    def __post_init__(self) -> None:
        if self.num_layers <= 0:
            raise ValueError(f"module {self.name!r}: num_layers must be positive")
        if self.kind in (ModuleKind.LLM, ModuleKind.TEXT_ENCODER) and self.vocab_size <= 0:
            raise ValueError(f"module {self.name!r}: a {self.kind.value} needs vocab_size")
        if self.kind is ModuleKind.VIT and self.out_hidden <= 0:
            raise ValueError(f"module {self.name!r}: a vit needs out_hidden (the LLM's hidden)")
        if self.kind is ModuleKind.DIT and self.cond_hidden <= 0:
            raise ValueError(f"module {self.name!r}: a dit needs cond_hidden")

    def llm_tokens_per_image(self, patches: int) -> int:
        """Tokens one image of `patches` ViT patches becomes in the LLM after the merge."""
        return max(1, patches // (self.merge * self.merge))


@dataclass(frozen=True)
class MultimodalSpec:
    """A multimodal model: its modules in data-flow order (producers before consumers)."""

    name: str
    modules: tuple[ModuleSpec, ...]

    def __post_init__(self) -> None:
        names = [m.name for m in self.modules]
        if len(set(names)) != len(names):
            raise ValueError(f"model {self.name!r}: duplicate module names {names}")
        seen: set[str] = set()
        for m in self.modules:
            seen.add(m.name)
            if m.feeds is not None and m.feeds not in names:
                raise ValueError(f"model {self.name!r}: {m.name} feeds unknown module {m.feeds!r}")
            if m.feeds is not None and m.feeds in seen:
                raise ValueError(f"model {self.name!r}: list {m.name} before {m.feeds}")
        sinks = [m.name for m in self.modules if m.feeds is None]
        if len(sinks) != 1:
            raise ValueError(
                f"model {self.name!r}: exactly one module must compute the loss, got {sinks}"
            )

    def module(self, name: str) -> ModuleSpec:
        for m in self.modules:
            if m.name == name:
                return m
        raise KeyError(f"model {self.name!r} has no module {name!r}")

    @property
    def loss_module(self) -> ModuleSpec:
        return next(m for m in self.modules if m.feeds is None)

    def producers_of(self, name: str) -> list[ModuleSpec]:
        return [m for m in self.modules if m.feeds == name]


# ---------------------------------------------------------------------------------------------
# The paper's component models (layers / hidden / FFN / heads / kv-groups), DESIGN.md section 3.

VIT_5B = LayerShape(1792, 15360, 16, 16)
VIT_22B = LayerShape(6144, 24576, 48, 48)
LLAMA3_8B = LayerShape(4096, 14336, 32, 8, gated_mlp=True)
QWEN2_32B = LayerShape(5120, 27648, 40, 8, gated_mlp=True)
QWEN2_72B = LayerShape(8192, 29568, 64, 8, gated_mlp=True)
DIT_5B = LayerShape(3584, 10240, 28, 28)
DIT_30B = LayerShape(6144, 24576, 48, 48)

_LLAMA_VOCAB = 128256
_QWEN_VOCAB = 152064


def _vlm(
    name: str, vit: LayerShape, vit_layers: int, llm: LayerShape, llm_layers: int, vocab: int
) -> MultimodalSpec:
    return MultimodalSpec(
        name,
        (
            ModuleSpec("vit", ModuleKind.VIT, vit_layers, vit, feeds="llm", out_hidden=llm.hidden),
            ModuleSpec("llm", ModuleKind.LLM, llm_layers, llm, vocab_size=vocab),
        ),
    )


def _t2v(
    name: str,
    te: LayerShape,
    te_layers: int,
    dit: LayerShape,
    dit_layers: int,
    vocab: int,
    *,
    train_text: bool,
    latent_channels: int = 16,
) -> MultimodalSpec:
    return MultimodalSpec(
        name,
        (
            ModuleSpec(
                "text",
                ModuleKind.TEXT_ENCODER,
                te_layers,
                te,
                trainable=train_text,
                feeds="dit",
                vocab_size=vocab,
            ),
            ModuleSpec(
                "dit",
                ModuleKind.DIT,
                dit_layers,
                dit,
                patch_size=2,
                in_channels=latent_channels,
                cond_hidden=te.hidden,
            ),
        ),
    )


@dataclass(frozen=True)
class Setup:
    """A paper setup: model, parallel sizes and the training batch it is measured on."""

    name: str
    model: MultimodalSpec
    tensor_parallel: int
    pipeline_parallel: int
    num_gpus: int
    seq_length: int = 8192
    global_batch_microbatches: int = 32  # packed sequences per global batch
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def data_parallel(self) -> int:
        return self.num_gpus // (self.tensor_parallel * self.pipeline_parallel)


PAPER_SETUPS: dict[str, Setup] = {
    s.name: s
    for s in (
        Setup("vlm-s", _vlm("ViT5B+Llama3-8B", VIT_5B, 63, LLAMA3_8B, 32, _LLAMA_VOCAB), 4, 4, 16),
        Setup("vlm-m", _vlm("ViT5B+Qwen2-32B", VIT_5B, 63, QWEN2_32B, 64, _QWEN_VOCAB), 8, 4, 32),
        Setup("vlm-l", _vlm("ViT22B+Qwen2-72B", VIT_22B, 48, QWEN2_72B, 80, _QWEN_VOCAB), 8, 8, 64),
        Setup(
            "t2v-s",
            _t2v("Llama3-8B+DiT5B", LLAMA3_8B, 32, DIT_5B, 28, _LLAMA_VOCAB, train_text=False),
            4,
            4,
            16,
        ),
        Setup(
            "t2v-l",
            _t2v("Qwen2-32B+DiT30B", QWEN2_32B, 64, DIT_30B, 48, _QWEN_VOCAB, train_text=False),
            8,
            8,
            64,
        ),
    )
}


def tiny_vlm(
    *, vit_layers: int = 8, llm_layers: int = 8, hidden: int = 32, vocab: int = 128
) -> MultimodalSpec:
    """A VLM small enough for CPU tests and the quick start (ViT on 8x8-pixel patches)."""
    vit = LayerShape(hidden, 2 * hidden, 4, 4)
    llm = LayerShape(hidden, 2 * hidden, 4, 2, gated_mlp=True)
    return MultimodalSpec(
        "tiny-vlm",
        (
            ModuleSpec(
                "vit",
                ModuleKind.VIT,
                vit_layers,
                vit,
                feeds="llm",
                patch_size=8,
                merge=2,
                out_hidden=hidden,
            ),
            ModuleSpec("llm", ModuleKind.LLM, llm_layers, llm, vocab_size=vocab),
        ),
    )


def tiny_t2v(
    *,
    text_layers: int = 8,
    dit_layers: int = 8,
    hidden: int = 32,
    vocab: int = 128,
    train_text: bool = True,
) -> MultimodalSpec:
    """A text-to-video model small enough for CPU tests (trainable text encoder by default)."""
    te = LayerShape(hidden, 2 * hidden, 4, 2, gated_mlp=True)
    dit = LayerShape(hidden, 2 * hidden, 4, 4)
    return _t2v(
        "tiny-t2v",
        te,
        text_layers,
        dit,
        dit_layers,
        vocab,
        train_text=train_text,
        latent_channels=4,
    )
