"""Packed-sequence attention: Megatron-Core's THD format for every attention of the models.

Every sub-microbatch packs its instances (documents, images, audio segments, clips, captions)
along one sequence, and every attention runs within one instance only. This is Megatron-Core's
packed-sequence format (`PackedSeqParams`, qkv_format "thd": cumulative segment lengths
`cu_seqlens_q/kv` and the longest segments `max_seqlen_q/kv`), which Transformer Engine's
`TEDotProductAttention` runs with FlashAttention / cuDNN kernels; no [S, S] mask exists
anywhere. Segments: each instance is one segment; the padding at the end of a sub-microbatch is
one more segment, attending only to itself (causally when the attention is causal), so no row
is fully masked and real tokens never see it. Cross-attention has different q and kv
segmentations: DiT clip j attends to its own caption only (`cross_attention_inputs`).

Without Transformer Engine, Megatron's local `DotProductAttention` refuses packed sequences;
`PackedAttention` takes its place in the layer specs (`packed_backend`) and computes the same
thing with one of two kernels:

* "segments": torch's `scaled_dot_product_attention` on each segment in turn (on the CPU that is
  its FlashAttention-style kernel: memory O(tokens) plus, for backward, each segment's output
  and log-sum-exp);
* "varlen": `torch.nn.attention.varlen.varlen_attn` (FlashAttention over the whole pack, CUDA,
  16-bit dtypes), when the installed torch has it.

"auto" picks varlen where it can run, else segments. Rotary positions stay per token (the
modalities' tables): Megatron applies a table covering the whole pack by offset within it.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from collections.abc import Sequence

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

KERNELS = ("auto", "varlen", "segments")
_CAUSAL = (AttnMaskType.causal, AttnMaskType.padding_causal)


def mask_type(*, causal: bool) -> AttnMaskType:
    """The attention mask type of packed (THD) attention: Transformer Engine takes only
    `padding_causal` and `padding` there (they do not imply padded tokens)."""
    return AttnMaskType.padding_causal if causal else AttnMaskType.padding


def segment_lengths(segments: torch.Tensor) -> list[int]:
    """Lengths of the attention segments of a packed sequence, in order, padding last.

    `segments` [S] int: each instance's tokens carry its (increasing) id, padding -1 at the end
    (`models.batch.segment_ids`). The padding forms one segment. Raises ValueError for ids that
    are not contiguous runs in increasing order, or padding that is not at the end.
    """
    ids = segments.detach().to("cpu", torch.int64)
    if ids.dim() != 1:
        raise ValueError(f"segment ids must be one-dimensional, got shape {tuple(ids.shape)}")
    if ids.numel() == 0:
        return []
    starts = torch.ones(ids.numel(), dtype=torch.bool)
    starts[1:] = ids[1:] != ids[:-1]
    first = torch.nonzero(starts)[:, 0]
    runs = ids[first]
    real = runs[runs >= 0]
    if (runs < 0).any() and runs[-1] >= 0 or (runs < 0).sum() > 1:
        raise ValueError("padding tokens (segment -1) must all come after the instances' tokens")
    if real.numel() > 1 and not bool((real[1:] > real[:-1]).all()):
        raise ValueError(f"segment ids must form increasing contiguous runs, got runs {runs}")
    return torch.diff(first, append=torch.tensor([ids.numel()])).tolist()


def packed_params(
    q_lengths: Sequence[int], kv_lengths: Sequence[int] | None = None, *, device
) -> PackedSeqParams:
    """Megatron's `PackedSeqParams` (THD) of q segments `q_lengths` attending to kv segments
    `kv_lengths` (segment i to segment i; the same segments when None)."""
    kv_lengths = q_lengths if kv_lengths is None else kv_lengths
    if len(kv_lengths) != len(q_lengths):
        raise ValueError(f"{len(q_lengths)} query segments but {len(kv_lengths)} key segments")

    def cumulative(lengths: Sequence[int]) -> torch.Tensor:
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(list(lengths), dtype=torch.int32).cumsum(0)
        return cu.to(device)

    cu_q = cumulative(q_lengths)
    cu_kv = cu_q if kv_lengths is q_lengths else cumulative(kv_lengths)
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_q,
        cu_seqlens_kv=cu_kv,
        max_seqlen_q=max(q_lengths, default=0),
        max_seqlen_kv=max(kv_lengths, default=0),
    )


def self_attention_kwargs(segments: torch.Tensor) -> dict:
    """Keyword arguments of a Megatron self-attention over the packed sequence `segments`
    (every segment attends to itself): no mask, its `PackedSeqParams`."""
    params = packed_params(segment_lengths(segments), device=segments.device)
    return {"attention_mask": None, "packed_seq_params": params}


def caption_rows(
    cond_index: torch.Tensor, caption_lengths: torch.Tensor, captions: torch.Tensor
) -> torch.Tensor:
    """Row indices (int64, CPU) into a caption encoding that holds captions `cond_index` one
    after the other (`caption_lengths[c]` rows each) of the captions `captions`, in order.
    Raises ValueError naming captions it does not hold."""
    lengths = caption_lengths.to("cpu", torch.int64)
    index = cond_index.to("cpu", torch.int64).tolist()
    starts = dict(zip(index, (torch.cumsum(lengths[index], 0) - lengths[index]).tolist()))
    wanted = captions.to("cpu", torch.int64).tolist()
    missing = sorted(set(wanted) - set(starts))
    if missing:
        raise ValueError(f"captions {missing} missing from cond")
    pieces = [torch.arange(starts[c], starts[c] + int(lengths[c])) for c in wanted]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)


def cross_attention_inputs(
    *,
    segments: torch.Tensor,
    clip_caption: torch.Tensor,
    caption_lengths: torch.Tensor,
    cond_index: torch.Tensor,
    cond: torch.Tensor,
) -> tuple[torch.Tensor, dict]:
    """(key/value states, attention keyword arguments) of the DiT cross-attention: clip j's
    tokens attend to the rows of caption `clip_caption[j]` only.

    `cond` [rows, 1, H] holds the captions `cond_index` one after the other
    (`caption_lengths[c]` rows each); the rows of the clips' captions are taken in clip order
    (all of `cond`, untouched, when it holds exactly those, as the DiT's messages do), so that
    q segment j (clip j) and kv segment j (its caption) line up. The padding after the last clip
    joins the last clip's q segment: a cross-attention row depends only on its own query, so
    this changes no real token, and every padding row attends to real caption rows (finite
    values, no fully masked row).
    """
    clips = segment_lengths(segments)
    real = len(clip_caption)
    if len(clips) > real:  # the padding segment joins the last clip
        if real == 0:
            raise ValueError("a DiT sub-microbatch without clips has nothing to cross-attend to")
        clips = [*clips[: real - 1], sum(clips[real - 1 :])]
    if len(clips) != real:
        raise ValueError(f"{len(clips)} clip segments for {real} clips")
    captions = clip_caption.to("cpu", torch.int64)
    kv_lengths = caption_lengths.to("cpu", torch.int64)[captions].tolist()
    params = packed_params(clips, kv_lengths, device=segments.device)
    if not torch.equal(cond_index.to("cpu", torch.int64), captions):
        rows = caption_rows(cond_index, caption_lengths, clip_caption)
        cond = cond.index_select(0, rows.to(cond.device))
    if cond.shape[0] != sum(kv_lengths):
        raise ValueError(f"cond holds {cond.shape[0]} rows, the clips' captions {sum(kv_lengths)}")
    return cond, {"attention_mask": None, "packed_seq_params": params}


@functools.cache
def _varlen():
    """`torch.nn.attention.varlen.varlen_attn`, or None where this torch lacks it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def varlen_available() -> bool:
    """Whether torch's FlashAttention varlen kernel can run here (CUDA and a torch with it)."""
    return torch.cuda.is_available() and _varlen() is not None


class PackedAttention(MegatronModule):
    """Core attention over packed sequences (module docstring), with the signature of
    Megatron's `DotProductAttention`: query [T, np, hn], key/value [Tk, ng, hn] (THD) and
    `packed_seq_params` -> [T, np * hn]. No dropout (the models use none), no dense mask.
    `kernel`: "auto", "varlen" or "segments".
    """

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
        *,
        kernel: str = "auto",
    ) -> None:
        super().__init__(config=config)
        del layer_number, cp_comm_type, pg_collection
        if kernel not in KERNELS:
            raise ValueError(f"packed attention kernel must be one of {KERNELS}, got {kernel!r}")
        if (attention_dropout if attention_dropout is not None else config.attention_dropout) > 0:
            raise ValueError("PackedAttention has no attention dropout")
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.kernel = kernel
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)

    def resolved_kernel(self, query: torch.Tensor) -> str:
        """The kernel this call runs: varlen needs CUDA and a 16-bit dtype."""
        if self.kernel != "auto":
            return self.kernel
        usable = query.is_cuda and query.dtype in (torch.float16, torch.bfloat16)
        return "varlen" if usable and _varlen() is not None else "segments"

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        """Attention of every query segment to its key/value segment (module docstring)."""
        if attention_mask is not None or attention_bias is not None:
            raise ValueError("PackedAttention takes no attention mask or bias, only packed params")
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            raise ValueError("PackedAttention needs PackedSeqParams with qkv_format 'thd'")
        causal = (attn_mask_type or self.attn_mask_type) in _CAUSAL
        if self.resolved_kernel(query) == "varlen":
            out = _run_varlen(query, key, value, packed_seq_params, causal, self.softmax_scale)
        else:
            out = _run_segments(query, key, value, packed_seq_params, causal, self.softmax_scale)
        return out.reshape(out.shape[0], -1)


def _run_segments(query, key, value, params: PackedSeqParams, causal: bool, scale: float):
    """SDPA on each (q segment, kv segment) pair; outputs concatenated in order."""
    q_lengths = torch.diff(params.cu_seqlens_q.cpu()).tolist()
    kv_lengths = torch.diff(params.cu_seqlens_kv.cpu()).tolist()
    if sum(q_lengths) != query.shape[0] or sum(kv_lengths) != key.shape[0]:
        raise ValueError(
            f"packed params cover {sum(q_lengths)} query / {sum(kv_lengths)} key tokens, the "
            f"tensors hold {query.shape[0]} / {key.shape[0]}"
        )
    gqa = query.shape[1] != key.shape[1]
    pieces, q0, k0 = [], 0, 0
    for nq, nk in zip(q_lengths, kv_lengths):
        if nq and nk:
            # [n, heads, dim] views -> [1, heads, n, dim]: SDPA keeps the views, no copies.
            q, k, v = (
                x.transpose(0, 1)[None]
                for x in (query[q0 : q0 + nq], key[k0 : k0 + nk], value[k0 : k0 + nk])
            )
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa
            )
            pieces.append(out[0].transpose(0, 1))
        elif nq:  # a query segment with no keys attends to nothing
            pieces.append(query.new_zeros(nq, query.shape[1], value.shape[2]))
        q0, k0 = q0 + nq, k0 + nk
    if not pieces:
        return query.new_zeros(0, query.shape[1], value.shape[2])
    # A new tensor even for one segment: what the kernel keeps does not depend on the count
    # of segments (`modalities.stored`: each segment's output and their concatenation).
    return torch.cat(pieces)


def _run_varlen(query, key, value, params: PackedSeqParams, causal: bool, scale: float):
    """torch's FlashAttention varlen kernel over the whole pack."""
    kernel = _varlen()
    query, key, value, options = varlen_arguments(
        _keywords(kernel), query, key, value, causal=causal, scale=scale
    )
    return kernel(
        query,
        key,
        value,
        params.cu_seqlens_q,
        params.cu_seqlens_kv,
        int(params.max_seqlen_q),
        int(params.max_seqlen_kv),
        **options,
    )


@functools.cache
def _keywords(function) -> frozenset[str]:
    return frozenset(inspect.signature(function).parameters)


def varlen_arguments(keywords, query, key, value, *, causal: bool, scale: float):
    """(query, key, value, keyword arguments) for a `varlen_attn` that takes `keywords`: its
    signature changed across torch releases (2.9: `is_causal`; later `window_size`, `scale`,
    `enable_gqa`). What an older one lacks is done here: the scale folded into the query (the
    kernel divides by sqrt(head dim)), grouped key/value heads repeated for their queries (as
    `enable_gqa` does: query head i reads key head i // (query heads / key heads))."""
    options = {}
    if "window_size" in keywords:
        options["window_size"] = (-1, 0) if causal else (-1, -1)
    elif causal:
        options["is_causal"] = True
    if "scale" in keywords:
        options["scale"] = scale
    else:
        query = query * (scale * math.sqrt(query.shape[-1]))
    if query.shape[1] != key.shape[1]:
        if "enable_gqa" in keywords:
            options["enable_gqa"] = True
        else:
            group = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    return query, key, value, options


def packed_backend(backend, *, kernel: str = "auto"):
    """`backend` (a `megatron_compat.LayerBackend`) with packed-sequence core attention: the
    Transformer Engine backend keeps `TEDotProductAttention` (THD) unless a kernel of ours is
    asked for; the local backend gets `PackedAttention` (Megatron's local `DotProductAttention`
    refuses packed sequences)."""
    if kernel not in KERNELS:
        raise ValueError(f"attention kernel must be one of {KERNELS}, got {kernel!r}")
    if backend.use_te and kernel == "auto":
        return backend
    # Megatron's attention classes call their core-attention builder directly (no ModuleSpec).
    core = functools.partial(PackedAttention, kernel=kernel)
    return dataclasses.replace(backend, core_attention=core)


def attention_label(backend) -> str:
    """What runs the attention cores of `backend` (after `packed_backend`), for profiles/logs."""
    core = backend.core_attention
    if isinstance(core, functools.partial) and core.func is PackedAttention:
        kernel = core.keywords.get("kernel", "auto")
        return f"megatron-dip PackedAttention ({kernel}; torch {torch.__version__})"
    return getattr(core, "__name__", str(core))
