"""Shapes of multimodal models: the vocabulary shared by the planner, the models and the tools.

Pure data, no torch, and nothing else of megatron_dip: the planner sizes and costs modules from
these specs, the modality files (`megatron_dip.modalities`) build Megatron-Core layers from the
same specs, so a preset means the same shapes everywhere. A module's `kind` names its modality
("vit", "llm", "text_encoder", "dit", "audio", ...); what a kind means — its token arithmetic,
messages, costs, chunk and loss — lives in that modality's own file, found through the registry
(`megatron_dip.modalities.modality_of`), which also checks the kind-specific fields
(`modalities.check_model`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from .parallel.shape import ParallelShape

# Defaults of the tiny presets' byte tokenizer (`data.tokenizer.ByteTokenizer`). A run with
# another tokenizer sets `ModuleSpec.pad_id` and `placeholder_id` from it (training.config.validate).
PAD_TOKEN = 0  # default padding id of the packed text sequences
IMAGE_TOKEN = 1  # default placeholder id of a vision encoder's instances in the LLM sequence


@dataclass(frozen=True)
class LayerShape:
    """One transformer layer: hidden size, FFN size, attention heads and key/value groups.

    `kv_channels`: the size of one attention head (Megatron-LM's --kv-channels); None: hidden /
    heads. With it set, the query projection is hidden -> heads * kv_channels (e.g. Gemma).
    """

    hidden: int
    ffn: int
    heads: int
    kv_groups: int
    gated_mlp: bool = False  # SwiGLU (LLMs) vs. GELU (ViT, DiT, audio encoder)
    kv_channels: int | None = None

    def __post_init__(self) -> None:
        if min(self.hidden, self.ffn, self.heads, self.kv_groups) <= 0:
            raise ValueError(f"layer sizes must be positive: {self}")
        if self.kv_channels is not None and self.kv_channels <= 0:
            raise ValueError(f"kv_channels must be positive: {self}")
        if (self.kv_channels is None and self.hidden % self.heads) or self.heads % self.kv_groups:
            raise ValueError(
                f"hidden {self.hidden} must divide into {self.heads} heads and the heads into "
                f"{self.kv_groups} key/value groups"
            )

    @property
    def head_dim(self) -> int:
        return self.kv_channels if self.kv_channels is not None else self.hidden // self.heads

    @property
    def attention_width(self) -> int:
        """Width of the query projection and of the attention output: heads x head size."""
        return self.heads * self.head_dim


ACTIVATIONS = ("gelu", "gelu_tanh", "quick_gelu", "silu")  # silu with gated_mlp: SwiGLU
PATCH_EMBEDDINGS = ("linear", "conv2d", "conv3d")
ROTARY_LAYOUTS = ("interleaved", "blocked")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's "llama3" rotary frequency scaling (Hugging Face `rope_scaling`): wavelengths
    longer than original_max_position_embeddings / low_freq_factor are divided by `factor`,
    those shorter than .../high_freq_factor kept, the band between interpolated smoothly."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int
    rope_type: str = "llama3"

    def __post_init__(self) -> None:
        if self.rope_type != "llama3":
            raise ValueError(f"unsupported rope scaling {self.rope_type!r} (supported: llama3)")
        if not (self.factor > 0 and self.high_freq_factor > self.low_freq_factor > 0):
            raise ValueError(f"llama3 rope scaling needs factor > 0, high > low > 0: {self}")
        if self.original_max_position_embeddings <= 0:
            raise ValueError(f"original_max_position_embeddings must be positive: {self}")


@dataclass(frozen=True)
class Architecture:
    """Options of a module's layers beyond their shapes: what makes a preset or a Hugging Face
    checkpoint the model it is named after.

    `rotary_base` and `rope_scaling` (None: plain rotary) shape the rotary frequencies;
    `mrope_sections`: Qwen2-VL's multimodal rotary sections (frequency slots per temporal, height,
    width axis), None for 1-D positions; `norm_eps`: epsilon of every norm; `qkv_bias`: biases on
    the query/key/value projection even where the other linear layers have none (Qwen2;
    Megatron's add_qkv_bias); `tie_embeddings`: the LLM output head is the input embedding;
    `activation`: the MLP activation (None: the kind's default, SwiGLU for gated MLPs, else GELU);
    `patch_embedding`: "linear" (a linear layer with bias on flattened patches) or "conv3d"
    (Qwen2-VL: a bias-free Conv3d with temporal kernel 2, i.e. frames stacked per patch);
    `rotary_layout` of multi-axis rotary positions: "interleaved" (frequency slot j rotates with
    axis j mod A) or "blocked" (Qwen2-VL's vision tower: the first slots with the rows, the
    next with the columns); `qk_norm`: an RMSNorm over each query and key head before the
    rotary embedding (Qwen3; Megatron's qk_layernorm); `family`: the Hugging Face model type the
    module was read from ("mistral", "qwen3", ...; written back on export), None where the
    options alone name it.

    Vision towers of CLIP / SigLIP (LLaVA): `learned_positions` > 0: a learned table of that
    many absolute positions added to the patch embeddings (no rotary), one per patch of the
    base-resolution image (plus the class token's); `class_token`: a learned class embedding
    before each image's patches (CLIP); `keep_class_token`: the hand-over keeps its row
    (LLaVA's vision_feature_select_strategy "full"; "default" drops it); `pre_norm`: a
    LayerNorm on the embeddings before the first layer (CLIP's pre_layrnorm); `final_norm`:
    the norm before the projector (False: LLaVA reads a layer's hidden states as they are);
    `projector_hidden`: the projector's inner width (None: its input width, Qwen2-VL; LLaVA:
    the LLM's hidden size); `patch_bias`: a "conv2d" patch embedding with a bias (SigLIP).

    `normalization`: the norm of the layers (and of the final norm), "LayerNorm" or "RMSNorm"
    (None: the kind's default). Window attention of a vision tower (Qwen2.5-VL):
    `window_size` > 0: each image's merged patches are grouped into windows of that many pixels
    per side; the layers in `full_attention_layers` (global indices) attend over the whole
    image, the others within their window only.

    `carried`: (Hugging Face name, shape) of checkpoint tensors the module does not compute
    with but a Hugging Face folder needs back (LLaVA's tower layers after
    `vision_feature_layer`, its post-layernorm, SigLIP's pooling head): frozen parameters of
    the last chunk, filled by the import, never trained, written back by the export.
    """

    rotary_base: float = 10000.0
    rope_scaling: RopeScaling | None = None
    mrope_sections: tuple[int, ...] | None = None
    norm_eps: float = 1e-5
    qkv_bias: bool = False
    tie_embeddings: bool = False
    activation: str | None = None
    patch_embedding: str = "linear"
    rotary_layout: str = "interleaved"
    qk_norm: bool = False
    family: str | None = None
    learned_positions: int = 0
    class_token: bool = False
    keep_class_token: bool = False
    pre_norm: bool = False
    final_norm: bool = True
    projector_hidden: int | None = None
    patch_bias: bool = False
    normalization: str | None = None
    window_size: int = 0
    full_attention_layers: tuple[int, ...] = ()
    carried: tuple[tuple[str, tuple[int, ...]], ...] = ()

    def __post_init__(self) -> None:
        carried = tuple((str(n), tuple(int(d) for d in shape)) for n, shape in self.carried)
        object.__setattr__(self, "carried", carried)
        object.__setattr__(
            self, "full_attention_layers", tuple(int(v) for v in self.full_attention_layers)
        )
        if self.normalization not in (None, *NORMALIZATIONS):
            raise ValueError(f"normalization {self.normalization!r} is not one of {NORMALIZATIONS}")
        if self.window_size < 0 or (self.full_attention_layers and not self.window_size):
            raise ValueError(
                f"window_size {self.window_size}: full_attention_layers "
                f"{self.full_attention_layers} need a positive window_size"
            )
        if self.rotary_layout not in ROTARY_LAYOUTS:
            raise ValueError(f"rotary_layout {self.rotary_layout!r} is not one of {ROTARY_LAYOUTS}")
        if not self.rotary_base > 0:
            raise ValueError(f"rotary_base must be positive, got {self.rotary_base}")
        if not self.norm_eps > 0:
            raise ValueError(f"norm_eps must be positive, got {self.norm_eps}")
        if self.activation is not None and self.activation not in ACTIVATIONS:
            raise ValueError(f"activation {self.activation!r} is not one of {ACTIVATIONS}")
        if self.patch_embedding not in PATCH_EMBEDDINGS:
            raise ValueError(
                f"patch_embedding {self.patch_embedding!r} is not one of {PATCH_EMBEDDINGS}"
            )
        if self.mrope_sections is not None:
            object.__setattr__(self, "mrope_sections", tuple(int(v) for v in self.mrope_sections))
            if len(self.mrope_sections) != 3 or min(self.mrope_sections) <= 0:
                raise ValueError(f"mrope_sections must be 3 positive slot counts: {self}")


@dataclass(frozen=True)
class ModuleSpec:
    """One modality module of a multimodal model.

    `feeds` names the module that consumes this one's output: a ViT or an audio encoder feeds the
    LLM (its projected embeddings replace its placeholder tokens, `placeholder_id`), a text
    encoder feeds the DiT (every DiT layer cross-attends to it). The module that feeds nobody
    computes the loss. A consumer may have several producers.

    Fields a kind does not use keep their defaults; each modality checks its own
    (`modalities.check_model`): `vocab_size` (llm, text_encoder), `patch_size` (vit: pixels per
    patch side; dit: latent patch side; audio: stride of the convolutional subsampling),
    `in_channels` (vit: image channels; dit: latent channels; audio: mel bins), `merge` (vit:
    patches merged per side into one LLM token, 52x52 -> 13x13 = 169; audio: encoder tokens
    pooled into one LLM token), `out_hidden` (producers: the consumer's hidden size),
    `cond_hidden` (dit: hidden size of the conditioning text encoding), `placeholder_id`
    (scatter producers: the token id of their placeholders in the consumer's text), `pad_id`
    (modules reading text: the id that pads their packed sequences, from the tokenizer),
    `arch` (rotary, norm, biases, tying, activation: `Architecture`).
    """

    name: str
    kind: str
    num_layers: int
    layer: LayerShape
    trainable: bool = True
    feeds: str | None = None
    vocab_size: int = 0
    patch_size: int = 14
    in_channels: int = 3
    merge: int = 4
    out_hidden: int = 0
    cond_hidden: int = 0
    placeholder_id: int | None = None
    pad_id: int = PAD_TOKEN
    arch: Architecture = Architecture()

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.kind, str) or not self.kind:
            raise ValueError(f"a module needs a name and a kind, got {self.name!r}/{self.kind!r}")
        if self.num_layers <= 0:
            raise ValueError(f"module {self.name!r}: num_layers must be positive")
        sections = self.arch.mrope_sections
        if sections is not None and 2 * sum(sections) != self.layer.head_dim:
            raise ValueError(
                f"module {self.name!r}: mrope_sections {sections} must sum to half the head "
                f"size {self.layer.head_dim}"
            )


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
        """The modules feeding `name`, in model order."""
        return [m for m in self.modules if m.feeds == name]

    def output_needs_gradients(self, name: str) -> bool:
        """Whether module `name`'s output needs gradients in backward: it, or a module feeding
        it (transitively), has trainable parameters."""
        return self.module(name).trainable or any(
            self.output_needs_gradients(m.name) for m in self.producers_of(name)
        )

    def modules_of_kind(self, kind: str) -> list[ModuleSpec]:
        """The modules of one kind, in model order."""
        return [m for m in self.modules if m.kind == kind]

    def replace_module(self, name: str, **changes) -> MultimodalSpec:
        """A copy with module `name`'s fields changed (`arch` may be a dict of its fields)."""
        old = self.module(name)
        if isinstance(changes.get("arch"), dict):
            changes["arch"] = replace(old.arch, **changes["arch"])
        new = tuple(replace(m, **changes) if m.name == name else m for m in self.modules)
        return replace(self, modules=new)


# ---------------------------------------------------------------------------------------------
# The paper's component models (layers / hidden / FFN / heads / kv-groups), docs/design.md, "Paper setups".

VIT_5B = LayerShape(1792, 15360, 16, 16)
VIT_22B = LayerShape(6144, 24576, 48, 48)
LLAMA3_8B = LayerShape(4096, 14336, 32, 8, gated_mlp=True)
QWEN2_32B = LayerShape(5120, 27648, 40, 8, gated_mlp=True)
QWEN2_72B = LayerShape(8192, 29568, 64, 8, gated_mlp=True)
DIT_5B = LayerShape(3584, 10240, 28, 28)
DIT_30B = LayerShape(6144, 24576, 48, 48)
WHISPER_LARGE = LayerShape(1280, 5120, 20, 20)  # 32 layers; 128 mel bins (large-v3)

_LLAMA_VOCAB = 128256
_QWEN_VOCAB = 152064

# The architecture options of the models the presets are named after (their config.json):
# Meta-Llama-3-8B (rope_theta 5e5, rms_norm_eps 1e-5, untied) and Qwen2-72B / Qwen2.5-32B
# (rope_theta 1e6, rms_norm_eps 1e-6, q/k/v biases, untied).
LLAMA3_ARCH = Architecture(rotary_base=500000.0, norm_eps=1e-5)
QWEN2_ARCH = Architecture(rotary_base=1000000.0, norm_eps=1e-6, qkv_bias=True)
_LLM_ARCH = {LLAMA3_8B: LLAMA3_ARCH, QWEN2_32B: QWEN2_ARCH, QWEN2_72B: QWEN2_ARCH}


def _arch(shape: LayerShape) -> Architecture:
    return _LLM_ARCH.get(shape, Architecture())


def _vit(layers: int, shape: LayerShape, llm: LayerShape, **extra) -> ModuleSpec:
    return ModuleSpec(
        "vit",
        "vit",
        layers,
        shape,
        feeds="llm",
        out_hidden=llm.hidden,
        placeholder_id=IMAGE_TOKEN,
        **extra,
    )


def _vlm(
    name: str, vit: LayerShape, vit_layers: int, llm: LayerShape, llm_layers: int, vocab: int
) -> MultimodalSpec:
    return MultimodalSpec(
        name,
        (
            _vit(vit_layers, vit, llm),
            ModuleSpec("llm", "llm", llm_layers, llm, vocab_size=vocab, arch=_arch(llm)),
        ),
    )


def _omni(
    name: str,
    *,
    vit: tuple[LayerShape, int],
    audio: tuple[LayerShape, int],
    llm: tuple[LayerShape, int],
    vocab: int,
    mel_bins: int,
    audio_token: int,
    **vit_extra,
) -> MultimodalSpec:
    """ViT + audio encoder (Whisper-style: conv subsampling by 2, tokens pooled by 2) + LLM."""
    llm_shape, llm_layers = llm
    return MultimodalSpec(
        name,
        (
            _vit(vit[1], vit[0], llm_shape, **vit_extra),
            ModuleSpec(
                "audio",
                "audio",
                audio[1],
                audio[0],
                feeds="llm",
                patch_size=2,
                in_channels=mel_bins,
                merge=2,
                out_hidden=llm_shape.hidden,
                placeholder_id=audio_token,
            ),
            ModuleSpec(
                "llm", "llm", llm_layers, llm_shape, vocab_size=vocab, arch=_arch(llm_shape)
            ),
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
                "text_encoder",
                te_layers,
                te,
                trainable=train_text,
                feeds="dit",
                vocab_size=vocab,
                arch=_arch(te),
            ),
            ModuleSpec(
                "dit",
                "dit",
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
    def shape(self) -> ParallelShape:
        """The setup's run as one value: its GPUs at TP x PP (DP the rest), bf16, one packed
        sequence per microbatch, and sequence parallelism asked for (in effect wherever TP > 1)."""
        return ParallelShape.for_world(
            self.num_gpus,
            tp=self.tensor_parallel,
            pp=self.pipeline_parallel,
            sp=True,
            dtype="bfloat16",
            seq_length=self.seq_length,
        )


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
        # Not in the paper: VLM-S with a Whisper-large-sized audio encoder (the third modality).
        Setup(
            "omni-s",
            _omni(
                "ViT5B+Whisper-large+Llama3-8B",
                vit=(VIT_5B, 63),
                audio=(WHISPER_LARGE, 32),
                llm=(LLAMA3_8B, 32),
                vocab=_LLAMA_VOCAB,
                mel_bins=128,
                audio_token=_LLAMA_VOCAB - 1,
            ),
            4,
            4,
            16,
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
            _vit(vit_layers, vit, llm, patch_size=8, merge=2),
            ModuleSpec("llm", "llm", llm_layers, llm, vocab_size=vocab),
        ),
    )


def tiny_omni(
    *,
    vit_layers: int = 4,
    audio_layers: int = 4,
    llm_layers: int = 8,
    hidden: int = 32,
    vocab: int = 128,
    mel_bins: int = 8,
) -> MultimodalSpec:
    """ViT + audio encoder + LLM small enough for CPU tests (the audio placeholder is the last
    vocabulary id, outside the tiny tokenizer's ids)."""
    vit = LayerShape(hidden, 2 * hidden, 4, 4)
    audio = LayerShape(hidden, 2 * hidden, 4, 4)
    llm = LayerShape(hidden, 2 * hidden, 4, 2, gated_mlp=True)
    return _omni(
        "tiny-omni",
        vit=(vit, vit_layers),
        audio=(audio, audio_layers),
        llm=(llm, llm_layers),
        vocab=vocab,
        mel_bins=mel_bins,
        audio_token=vocab - 1,
        patch_size=8,
        merge=2,
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


def module_record(spec: ModuleSpec) -> dict:
    """A JSON-able record of `spec` (its every field; `module_from_record` inverts it): what a
    checkpoint keeps of the modules it was saved from."""
    return asdict(spec)


def module_from_record(record: dict) -> ModuleSpec:
    """The `ModuleSpec` of a `module_record` (ValueError on a malformed one)."""
    try:
        fields = dict(record)
        arch = dict(fields.pop("arch"))
        if arch.get("rope_scaling") is not None:
            arch["rope_scaling"] = RopeScaling(**arch["rope_scaling"])
        return ModuleSpec(
            layer=LayerShape(**fields.pop("layer")), arch=Architecture(**arch), **fields
        )
    except (KeyError, TypeError) as e:
        raise ValueError(f"not a module record ({e}): {record}") from None
