"""Which Hugging Face tensors make up each of our global parameters (torch-free).

Each of our global tensors (keyed by global parameter name, `models.init.global_param_name`)
is the concatenation along dim 0 of row ranges of Hugging Face tensors (`Piece`s):

* most are one whole tensor (embeddings, norms, o_proj -> linear_proj, down_proj -> fc2);
* Megatron's fused `linear_qkv` holds, for each key/value group in turn, that group's query
  heads, then its key head, then its value head ([ng, (np/ng + 2), d, h]): pieces of q_proj,
  k_proj and v_proj per group (their biases alike);
* a gated MLP's `linear_fc1` is [gate; up] (the global layout of `models.sharded`): gate_proj
  then up_proj.

Reading rows [a, b) of one of our tensors is then a walk over its pieces (`weights`), which is
how a tensor-parallel rank reads only its shard; writing a Hugging Face tensor back is the same
walk inverted. Names of the Transformer Engine layer spec (norms fused into the next linear
layer) are listed as aliases of the local spec's.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_dip.modelspec import ModuleSpec


@dataclass(frozen=True)
class Piece:
    """Rows [start, start + rows) of Hugging Face tensor `name` (rows None: all of them, only
    where the piece is the whole of our tensor: then ours may have more rows, e.g. a padded
    vocabulary)."""

    name: str
    start: int = 0
    rows: int | None = None


@dataclass(frozen=True)
class TensorMap:
    """Our global tensor `key` = the concatenation of `pieces` along dim 0. `hf_tail`: the
    trailing dims of a Hugging Face tensor that ours holds flattened (a Conv3d kernel)."""

    key: str
    pieces: tuple[Piece, ...]
    hf_tail: tuple[int, ...] | None = None


# Our local-spec names -> the Transformer Engine spec's names of the same tensor.
_TE_ALIASES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias",
}


def _with_aliases(maps: list[TensorMap]) -> dict[str, TensorMap]:
    out = {t.key: t for t in maps}
    for t in maps:
        for local, te in _TE_ALIASES.items():
            if t.key.endswith(local):
                alias = t.key[: -len(local)] + te
                out[alias] = TensorMap(alias, t.pieces, t.hf_tail)
    return out


def qkv_pieces(prefix: str, leaf: str, spec: ModuleSpec) -> tuple[Piece, ...]:
    """Pieces of Megatron's fused query/key/value weight or bias (`leaf` "weight" / "bias")
    from q_proj, k_proj, v_proj under `prefix` (module docstring)."""
    lay = spec.layer
    d, per_group = lay.head_dim, lay.heads // lay.kv_groups
    out: list[Piece] = []
    for g in range(lay.kv_groups):
        out.append(Piece(f"{prefix}q_proj.{leaf}", g * per_group * d, per_group * d))
        out.append(Piece(f"{prefix}k_proj.{leaf}", g * d, d))
        out.append(Piece(f"{prefix}v_proj.{leaf}", g * d, d))
    return tuple(out)


def _layer_maps(spec: ModuleSpec, ours: str, hf: str) -> list[TensorMap]:
    """The tensors of one decoder layer: ours under `ours`, Hugging Face's under `hf`."""
    attn = f"{hf}self_attn."
    maps = [
        TensorMap(f"{ours}input_layernorm.weight", (Piece(f"{hf}input_layernorm.weight"),)),
        TensorMap(f"{ours}self_attention.linear_qkv.weight", qkv_pieces(attn, "weight", spec)),
        TensorMap(f"{ours}self_attention.linear_proj.weight", (Piece(f"{attn}o_proj.weight"),)),
        TensorMap(
            f"{ours}pre_mlp_layernorm.weight", (Piece(f"{hf}post_attention_layernorm.weight"),)
        ),
        TensorMap(
            f"{ours}mlp.linear_fc1.weight",
            (
                Piece(f"{hf}mlp.gate_proj.weight", 0, spec.layer.ffn),
                Piece(f"{hf}mlp.up_proj.weight", 0, spec.layer.ffn),
            ),
        ),
        TensorMap(f"{ours}mlp.linear_fc2.weight", (Piece(f"{hf}mlp.down_proj.weight"),)),
    ]
    if spec.arch.qkv_bias:
        maps.append(
            TensorMap(f"{ours}self_attention.linear_qkv.bias", qkv_pieces(attn, "bias", spec))
        )
    if spec.arch.qk_norm:  # Qwen3: one RMSNorm weight of head_dim for all query heads, one for keys
        for our_norm, hf_norm in (("q_layernorm", "q_norm"), ("k_layernorm", "k_norm")):
            maps.append(
                TensorMap(
                    f"{ours}self_attention.{our_norm}.weight", (Piece(f"{attn}{hf_norm}.weight"),)
                )
            )
    return maps


def decoder_prefix(names) -> str:
    """Where a decoder's tensors lie in a checkpoint holding `names`: "model." (*ForCausalLM),
    "model.language_model." (transformers-5 Qwen2-VL) or "" (a bare LlamaModel / Qwen2Model)."""
    for prefix in ("model.language_model.", "language_model.model.", "model.", ""):
        if f"{prefix}embed_tokens.weight" in names:
            return prefix
    raise ValueError("no embed_tokens.weight in the checkpoint: not a Llama / Qwen2 decoder")


def decoder_maps(
    spec: ModuleSpec, *, hf_prefix: str = "model.", head: str | None = "lm_head.weight"
) -> dict[str, TensorMap]:
    """{our global name: TensorMap} of a Llama / Qwen2 decoder as module `spec` (an LLM or a
    text encoder). `hf_prefix`: where the decoder's tensors lie ("model." in a *ForCausalLM
    checkpoint, "model.language_model." in a transformers-5 Qwen2-VL one); `head`: the output
    projection's name (the LLM's head when its embeddings are untied)."""
    m = spec.name
    maps = [
        TensorMap(f"{m}.pre.word_embeddings.weight", (Piece(f"{hf_prefix}embed_tokens.weight"),))
    ]
    for i in range(spec.num_layers):
        maps += _layer_maps(spec, f"{m}.layers.{i}.", f"{hf_prefix}layers.{i}.")
    maps.append(TensorMap(f"{m}.post.final_norm.weight", (Piece(f"{hf_prefix}norm.weight"),)))
    if spec.kind == "llm" and not spec.arch.tie_embeddings and head is not None:
        maps.append(TensorMap(f"{m}.post.output_layer.weight", (Piece(head),)))
    return _with_aliases(maps)


def vision_prefix(names) -> str:
    """Where a Qwen2-VL vision tower lies: "model.visual." (transformers 5) or "visual."."""
    for prefix in ("model.visual.", "visual."):
        if f"{prefix}patch_embed.proj.weight" in names:
            return prefix
    raise ValueError("no visual.patch_embed.proj.weight in the checkpoint: not a Qwen2-VL model")


def _fused_qkv_pieces(name: str, spec: ModuleSpec) -> tuple[Piece, ...]:
    """Megatron's per-head [q_h; k_h; v_h] rows from one fused [q; k; v] tensor (Qwen2-VL's
    vision attention: every head its own key/value group)."""
    d, width = spec.layer.head_dim, spec.layer.attention_width
    return tuple(
        Piece(name, part * width + h * d, d) for h in range(spec.layer.heads) for part in range(3)
    )


def _tower_layer_maps(
    spec: ModuleSpec, hf_layers: str, ours_hf: dict[str, str], qkv
) -> list[TensorMap]:
    """The maps of a vision tower's layers (weights and biases): `ours_hf` renames the plain
    tensors below `hf_layers`{i}.; `qkv(hf_layer_prefix, leaf)` gives the fused qkv's pieces,
    which each tower's checkpoint stores its own way."""
    maps = []
    for i in range(spec.num_layers):
        ours, hf = f"{spec.name}.layers.{i}.", f"{hf_layers}{i}."
        for leaf in ("weight", "bias"):
            for our_name, hf_name in ours_hf.items():
                maps.append(
                    TensorMap(f"{ours}{our_name}.{leaf}", (Piece(f"{hf}{hf_name}.{leaf}"),))
                )
            maps.append(TensorMap(f"{ours}self_attention.linear_qkv.{leaf}", qkv(hf, leaf)))
    return maps


def _qwen_vision_mlp_maps(spec: ModuleSpec, ours: str, hf: str) -> list[TensorMap]:
    """A Qwen2.5-VL vision block's gated MLP (biases too): fc1 = [gate_proj; up_proj]."""
    maps = []
    for leaf in ("weight", "bias"):
        pieces = tuple(
            Piece(f"{hf}mlp.{name}.{leaf}", 0, spec.layer.ffn) for name in ("gate_proj", "up_proj")
        )
        maps.append(TensorMap(f"{ours}mlp.linear_fc1.{leaf}", pieces))
        maps.append(
            TensorMap(f"{ours}mlp.linear_fc2.{leaf}", (Piece(f"{hf}mlp.down_proj.{leaf}"),))
        )
    return maps


def vision_maps(spec: ModuleSpec, *, hf_prefix: str = "model.visual.") -> dict[str, TensorMap]:
    """{our global name: TensorMap} of a Qwen2-VL or Qwen2.5-VL vision tower (patch embedding,
    blocks, and the merger: ln_q -> our final norm, mlp.0 / mlp.2 -> merger_fc1 / merger_fc2)
    as `spec` (Qwen2.5-VL's: RMSNorms without biases, a gated MLP)."""
    m, p = spec.name, hf_prefix
    kernel = (spec.in_channels, 2, spec.patch_size, spec.patch_size)
    maps = [
        TensorMap(f"{m}.pre.patch_embed.weight", (Piece(f"{p}patch_embed.proj.weight"),), kernel)
    ]
    gated = spec.layer.gated_mlp
    norms = ("weight",) if spec.arch.normalization == "RMSNorm" else ("weight", "bias")
    ours_hf = {"self_attention.linear_proj": "attn.proj"}
    if not gated:
        ours_hf.update({"mlp.linear_fc1": "mlp.fc1", "mlp.linear_fc2": "mlp.fc2"})
    maps += _tower_layer_maps(
        spec,
        f"{p}blocks.",
        ours_hf,
        lambda hf, leaf: _fused_qkv_pieces(f"{hf}attn.qkv.{leaf}", spec),
    )
    for i in range(spec.num_layers):
        ours, hf = f"{m}.layers.{i}.", f"{p}blocks.{i}."
        for leaf in norms:
            for our_name, hf_name in (("input_layernorm", "norm1"), ("pre_mlp_layernorm", "norm2")):
                maps.append(
                    TensorMap(f"{ours}{our_name}.{leaf}", (Piece(f"{hf}{hf_name}.{leaf}"),))
                )
        if gated:
            maps += _qwen_vision_mlp_maps(spec, ours, hf)
    for leaf in norms:
        maps.append(TensorMap(f"{m}.post.final_norm.{leaf}", (Piece(f"{p}merger.ln_q.{leaf}"),)))
    for leaf in ("weight", "bias"):
        for our_name, hf_name in (("merger_fc1", "mlp.0"), ("merger_fc2", "mlp.2")):
            maps.append(
                TensorMap(f"{m}.post.{our_name}.{leaf}", (Piece(f"{p}merger.{hf_name}.{leaf}"),))
            )
    return _with_aliases(maps)


def _first_prefix(names, prefixes: tuple[str, ...], leaf: str, what: str) -> str:
    for prefix in prefixes:
        if f"{prefix}{leaf}" in names:
            return prefix
    raise ValueError(f"no {prefixes[-1]}{leaf} in the checkpoint: not a {what}")


def llava_vision_maps(spec: ModuleSpec, names) -> dict[str, TensorMap]:
    """{our global name: TensorMap} of a LLaVA CLIP / SigLIP tower (its first
    `spec.num_layers` layers and its carried tensors) and projector, wherever the checkpoint
    keeps them (transformers 5's "model.vision_tower." or the Hub's
    "vision_tower.[vision_model.]"). Raises ValueError naming the tower's tensors that are
    neither read nor carried (an export could not write them back)."""
    p = _first_prefix(
        names,
        (
            "model.vision_tower.vision_model.",
            "model.vision_tower.",
            "vision_tower.vision_model.",
            "vision_tower.",
        ),
        "embeddings.patch_embedding.weight",
        "LLaVA model",
    )
    proj = _first_prefix(
        names,
        ("model.multi_modal_projector.", "multi_modal_projector."),
        "linear_1.weight",
        "LLaVA model (no projector)",
    )
    maps = llava_tower_maps(spec, tower=p, projector=proj)
    covered = {piece.name for t in maps.values() for piece in t.pieces}
    left = sorted(n for n in names if n.startswith(p) and n not in covered)
    if left:
        raise ValueError(
            f"{len(left)} tensors of the vision tower are neither read nor carried (e.g. "
            f"{left[:3]}): does config.json describe these weights?"
        )
    return maps


def llava_tower_maps(spec: ModuleSpec, *, tower: str, projector: str) -> dict[str, TensorMap]:
    """The maps of a LLaVA tower below `tower` and its projector below `projector`."""
    m, p = spec.name, tower
    kernel = (spec.in_channels, spec.patch_size, spec.patch_size)
    emb = f"{p}embeddings."
    maps = [
        TensorMap(f"{m}.pre.patch_embed.weight", (Piece(f"{emb}patch_embedding.weight"),), kernel),
        TensorMap(f"{m}.pre.positions.weight", (Piece(f"{emb}position_embedding.weight"),)),
    ]
    if spec.arch.patch_bias:
        maps.append(TensorMap(f"{m}.pre.patch_embed.bias", (Piece(f"{emb}patch_embedding.bias"),)))
    if spec.arch.class_token:
        maps.append(
            TensorMap(f"{m}.pre.positions.class_embedding", (Piece(f"{emb}class_embedding"),))
        )
    if spec.arch.pre_norm:
        for leaf in ("weight", "bias"):
            maps.append(TensorMap(f"{m}.pre.pre_norm.{leaf}", (Piece(f"{p}pre_layrnorm.{leaf}"),)))
    ours_hf = {
        "input_layernorm": "layer_norm1", "pre_mlp_layernorm": "layer_norm2",
        "self_attention.linear_proj": "self_attn.out_proj", "mlp.linear_fc1": "mlp.fc1",
        "mlp.linear_fc2": "mlp.fc2",
    }  # fmt: skip
    maps += _tower_layer_maps(
        spec,
        f"{p}encoder.layers.",
        ours_hf,
        lambda hf, leaf: qkv_pieces(f"{hf}self_attn.", leaf, spec),
    )
    for leaf in ("weight", "bias"):
        for our_name, hf_name in (("merger_fc1", "linear_1"), ("merger_fc2", "linear_2")):
            maps.append(
                TensorMap(f"{m}.post.{our_name}.{leaf}", (Piece(f"{projector}{hf_name}.{leaf}"),))
            )
    for i, (name, shape) in enumerate(spec.arch.carried):
        tail = tuple(shape[1:]) if len(shape) > 2 else None
        maps.append(TensorMap(f"{m}.post.carried.{i}", (Piece(f"{p}{name}"),), tail))
    return _with_aliases(maps)


def vlm_export_maps(vit: ModuleSpec, llm: ModuleSpec) -> dict[str, TensorMap]:
    """The maps of a ViT + LLM pair under the names transformers' `save_pretrained` writes
    (and the Hub holds): LLaVA's (learned positions), else Qwen2-VL's / Qwen2.5-VL's."""
    if vit.arch.learned_positions:
        text = decoder_maps(
            llm, hf_prefix="language_model.model.", head="language_model.lm_head.weight"
        )
        tower = llava_tower_maps(vit, tower="vision_tower.", projector="multi_modal_projector.")
        return {**tower, **text}
    return {**vision_maps(vit, hf_prefix="visual."), **decoder_maps(llm, hf_prefix="model.")}


def module_maps(spec: ModuleSpec, names) -> dict[str, TensorMap]:
    """The maps of module `spec` in a checkpoint holding tensor `names` (where its tensors lie is
    read from the names; an untied head of a tied checkpoint reads the input embedding)."""
    if spec.kind == "vit" and spec.arch.learned_positions:
        return llava_vision_maps(spec, names)
    if spec.kind == "vit":
        return vision_maps(spec, hf_prefix=vision_prefix(names))
    prefix = decoder_prefix(names)
    head = next(
        (h for h in ("lm_head.weight", "language_model.lm_head.weight") if h in names),
        f"{prefix}embed_tokens.weight",
    )
    return decoder_maps(spec, hf_prefix=prefix, head=head)
