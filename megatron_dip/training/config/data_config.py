"""The run's tokenizer, the model's text ids and the data's readers, from the flags (torch-free).

Part of `validate.resolve`, before any process group exists. The tokenizer (--tokenizer-type,
--tokenizer-model, --dip-special-tokens, --tokenizer-prompt-format) is loaded once to read its
ids: with a real tokenizer the model's vocabulary is the tokenizer's padded as Megatron-LM pads it
(--make-vocab-size-divisible-by x TP, unless --vocab-size), its pad id the tokenizer's, and each
scatter producer's placeholder id the tokenizer's token of that producer's role (Qwen2-VL's
`<|image_pad|>`, ...); the byte tokenizer keeps the tiny presets' ids. The data's readers are
configured and checked (vocabulary, prompt format, processor config vs the ViT's grid).
"""

from __future__ import annotations

import dataclasses

from megatron_dip.data.tokenizer import (
    BYTE_TOKENIZER,
    Tokenizer,
    TokenizerSpec,
    load_tokenizer,
    padded_vocab_size,
)
from megatron_dip.modalities import ScatterProducer, check_model, modality_of
from megatron_dip.modelspec import MultimodalSpec

from .architecture import apply_architecture, hf_folders
from .arguments import ConfigError, TrainConfig
from .arguments import fail as _fail
from .data_source import DataSpec, image_config
from .presets import RunPreset


def parse_special_tokens(text: str | None) -> tuple[tuple[str, str], ...]:
    """`--dip-special-tokens image=<|image_pad|>,pad=<|endoftext|>` as (role, token) pairs."""
    pairs = []
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        role, sep, token = part.partition("=")
        if not sep or not role.strip() or not token.strip():
            raise _fail("--dip-special-tokens", f"{part!r} is not ROLE=TOKEN")
        pairs.append((role.strip(), token.strip()))
    return tuple(pairs)


def run_tokenizer(config: TrainConfig) -> tuple[TokenizerSpec, Tokenizer]:
    """The run's tokenizer (--tokenizer-type, --tokenizer-model, --dip-special-tokens,
    --tokenizer-prompt-format), loaded to check it and to read its ids."""
    d = config.data
    try:
        spec = TokenizerSpec(
            type=d.tokenizer_type or BYTE_TOKENIZER,
            model=d.tokenizer_model,
            special=parse_special_tokens(config.dip.dip_special_tokens),
            prompt_format=d.tokenizer_prompt_format,
        )
        return spec, load_tokenizer(spec)
    except ImportError as e:
        raise _fail("--tokenizer-type", str(e)) from None
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _text_updates(
    config: TrainConfig, tokenizer: Tokenizer, *, tp: int, hf_vocab: int | None = None
) -> dict:
    """A text module's --vocab-size, and with a real tokenizer its padded vocabulary (Megatron's
    rule, --make-vocab-size-divisible-by x TP; a Hugging Face config's `hf_vocab` instead: its
    weights have that many rows) and its pad id."""
    vocab, updates, flag = config.model.vocab_size, {}, "--vocab-size"
    if vocab is None and hf_vocab is not None:
        vocab, flag = hf_vocab, "--dip-hf-config"
    if vocab is not None:
        if vocab < 3:
            raise _fail(flag, f"must be >= 3 (PAD, IMAGE and text), got {vocab}")
        updates["vocab_size"] = vocab
    if tokenizer.name == BYTE_TOKENIZER:
        return updates  # the tiny presets' ids (pad 0, image 1) are the byte tokenizer's
    size, divisible = tokenizer.vocab_size, config.data.make_vocab_size_divisible_by
    if divisible < 1:
        raise _fail("--make-vocab-size-divisible-by", f"must be >= 1, got {divisible}")
    if vocab is None:
        updates["vocab_size"] = padded_vocab_size(size, divisible_by=divisible, tensor_parallel=tp)
    elif vocab < size:
        raise _fail(flag, f"{vocab} is smaller than the tokenizer's {size} ids")
    updates["pad_id"] = tokenizer.pad_id
    return updates


def _placeholder(spec, tokenizer: Tokenizer) -> int | None:
    """A scatter producer's placeholder id from a real tokenizer (None: keep the preset's)."""
    modality = modality_of(spec)
    if tokenizer.name == BYTE_TOKENIZER or not isinstance(modality, ScatterProducer):
        return None
    token = tokenizer.special_id(modality.placeholder_role)
    if token is None:
        role = modality.placeholder_role
        raise _fail(
            "--dip-special-tokens",
            f"the tokenizer has no {role} placeholder token for module {spec.name!r}; add one "
            f"to the tokenizer or name it: --dip-special-tokens {role}=TOKEN",
        )
    return token


def _model(config: TrainConfig, base: MultimodalSpec, tokenizer: Tokenizer) -> MultimodalSpec:
    m = config.model
    model = apply_architecture(config, base)
    from_hf = hf_folders(config, base)  # their vocabulary is the checkpoint's
    loss = model.loss_module.name
    tp = config.parallel.tensor_model_parallel_size or 1
    changed = []
    for spec in model.modules:
        updates = {}
        layers = m.num_layers if spec.name == loss else m.encoder_num_layers
        if layers is not None:
            flag = "--num-layers" if spec.name == loss else "--encoder-num-layers"
            if layers < 1:
                raise _fail(flag, f"must be >= 1, got {layers}")
            if spec.name in from_hf and layers != spec.num_layers:
                raise _fail(
                    flag,
                    f"{layers} contradicts num_hidden_layers / depth {spec.num_layers} in "
                    f"{from_hf[spec.name]}/config.json (module {spec.name!r}); drop the flag",
                )
            updates["num_layers"] = layers
        if spec.vocab_size > 0:
            hf_vocab = spec.vocab_size if spec.name in from_hf else None
            updates.update(_text_updates(config, tokenizer, tp=tp, hf_vocab=hf_vocab))
        token = _placeholder(spec, tokenizer)
        if token is not None:
            updates["placeholder_id"] = token
        changed.append(dataclasses.replace(spec, **updates) if updates else spec)
    model = dataclasses.replace(model, modules=tuple(changed))
    _check_special_ids(model)
    try:
        return check_model(model)
    except ValueError as e:
        raise _fail("--model", str(e)) from None


def _check_special_ids(model: MultimodalSpec) -> None:
    """Placeholder ids must differ from each other and from the pad id of their consumer (the
    padding of a packed sequence would otherwise count as placeholders)."""
    seen: dict[int, str] = {}
    for spec in model.modules:
        token = spec.placeholder_id
        if token is None or spec.feeds is None:
            continue
        pad = model.module(spec.feeds).pad_id
        if token == pad or token in seen:
            other = "the pad id" if token == pad else f"module {seen[token]!r}'s placeholder"
            raise _fail(
                "--dip-special-tokens",
                f"module {spec.name!r}'s placeholder id {token} is also {other}; name distinct "
                "tokens (e.g. --dip-special-tokens pad=<|endoftext|>)",
            )
        seen[token] = spec.name


def _max_sample_tokens(config: TrainConfig) -> int | None:
    """--dip-max-sample-tokens (checked), or --seq-length when truncating."""
    d, seq = config.dip, config.train.seq_length
    if d.dip_max_sample_tokens is None:
        return seq if d.dip_bad_samples == "truncate" else None
    if not 1 <= d.dip_max_sample_tokens <= seq:
        raise _fail(
            "--dip-max-sample-tokens",
            f"must lie in [1, --seq-length={seq}], got {d.dip_max_sample_tokens}",
        )
    return d.dip_max_sample_tokens


def _check_reading(data: DataSpec, model: MultimodalSpec, tokenizer: Tokenizer) -> None:
    """What the file readers would refuse, refused now: a vocabulary smaller than the
    tokenizer's, a prompt format the tokenizer cannot write, a processor config for another
    patch grid."""
    from megatron_dip.data.chat import make_encoder
    from megatron_dip.data.image_text import image_module
    from megatron_dip.modalities import text_module

    vocab = text_module(model).vocab_size
    if vocab < tokenizer.vocab_size:
        raise _fail(
            "--vocab-size",
            f"the model's vocabulary ({vocab}) is smaller than the {tokenizer.name}'s "
            f"({tokenizer.vocab_size})",
        )
    vit = image_module(model)
    try:
        if vit is not None:
            data.image.check_vit(patch=vit.patch_size, merge=vit.merge)
        if data.kind != "latents":
            image_id = None if vit is None else modality_of(vit).placeholder_id(vit)
            make_encoder(tokenizer, data.tokenizer.prompt_format, image_id=image_id)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def data_spec(
    config: TrainConfig, model: MultimodalSpec, tokenizer_spec, tokenizer, *, dp: int
) -> DataSpec:
    """The parsed and checked --dip-data with its readers' settings."""
    d = config.dip
    if config.data.num_workers < 1:
        raise _fail("--num-workers", f"must be >= 1, got {config.data.num_workers}")
    try:
        image = image_config(
            processor=d.dip_image_processor,
            max_pixels=d.dip_max_pixels,
            image_size=d.dip_image_size,
        )
        data = DataSpec.parse(
            d.dip_data,
            scale=d.dip_data_scale,
            image_size=d.dip_image_size,
            bad_samples=d.dip_bad_samples,
            tokenizer=tokenizer_spec,
            image=image,
            max_tokens=_max_sample_tokens(config),
            slots=dp * config.data.num_workers,
            cooker=d.dip_energon_cooker,
            allow_outside_paths=d.dip_allow_outside_paths,
        )
        data.check_model(model)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if data.reads_text:
        _check_reading(data, model, tokenizer)
    return data


def model_spec(
    config: TrainConfig, preset: RunPreset | None, *, base: MultimodalSpec | None = None
) -> tuple[MultimodalSpec, TokenizerSpec, Tokenizer]:
    """The checked model of `preset` (or of `base`, e.g. a Hugging Face folder's own model)
    under the flags, with the run's tokenizer."""
    tokenizer_spec, tokenizer = run_tokenizer(config)
    if base is None:
        base = preset.model()
    return _model(config, base, tokenizer), tokenizer_spec, tokenizer
