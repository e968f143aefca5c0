"""The analytic cost model: paper ballparks, scaling laws, recompute, TP, profiles, calibration."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from megatron_dip.modelspec import PAPER_SETUPS, tiny_t2v
from megatron_dip.parallel import ParallelShape
from megatron_dip.planner.cost_model import CPU_KERNELS, CostModel, Kernels, load_profile
from megatron_dip.planner.devices import DEVICES, H100, H800, get_device, match_device
from megatron_dip.schedule.ir import ChunkSpec, MemoryPolicy, Recompute, SubMicrobatch

VLM_S = PAPER_SETUPS["vlm-s"]  # ViT-5B + Llama3-8B, TP4
VLM_M = PAPER_SETUPS["vlm-m"]  # ViT-5B + Qwen2-32B, TP8: the paper's 37B VLM


def _mid(module: str) -> ChunkSpec:
    """A chunk of one inner layer (no embedding or head)."""
    return ChunkSpec(module, 1, 0, 5, 6)


def _sub(module: str, instances: int, tokens: int, pairs: int = 0) -> SubMicrobatch:
    return SubMicrobatch(module, 0, 0, 0, instances, tokens, tokens, pairs)


def _layer_ms(cm: CostModel, module: str, instances: int, tokens: int, pairs: int = 0) -> float:
    c = cm.stage_cost(_mid(module), _sub(module, instances, tokens, pairs))
    return (c.forward + c.backward) * 1e3


def test_device_presets() -> None:
    assert get_device("h800") is H800 and set(DEVICES) == {"A100", "H100", "H200", "H800", "B200"}
    assert H800.nvlink_bandwidth < H100.nvlink_bandwidth
    assert DEVICES["H200"].hbm_bandwidth > H100.hbm_bandwidth
    a100, b200 = DEVICES["A100"], DEVICES["B200"]
    assert a100.peak_flops < H100.peak_flops < b200.peak_flops  # 312 / 989 / 2250 TFLOPS
    assert a100.hbm_bandwidth < H100.hbm_bandwidth < b200.hbm_bandwidth
    assert (a100.nvlink_bandwidth, b200.nvlink_bandwidth) == (600e9, 1800e9)
    with pytest.raises(ValueError, match="A100, B200, H100, H200, H800"):
        get_device("V100")
    assert match_device("NVIDIA A100-SXM4-40GB") == "A100"
    assert match_device("NVIDIA H100 80GB HBM3") == "H100"
    assert match_device("NVIDIA B200") == "B200"
    assert match_device("NVIDIA GeForce RTX 4090") is None


def test_paper_vlm_layers_are_in_the_right_ballpark() -> None:
    # Paper (37B VLM, TP8): ViT layer 6.75 ms, LLM layer 10.5 ms, forward + backward.
    for setup, device in ((VLM_S, H100), (VLM_M, H800)):
        cm = CostModel(setup.model, device, shape=ParallelShape(tp=setup.tensor_parallel))
        llm = _layer_ms(cm, "llm", 1, 8192, 8 * 1024**2)  # 8 packed documents of 1024 tokens
        assert 3.0 < llm < 25.0
        # Per token a ViT-5B layer is far cheaper than the LLM's ...
        assert 0.15 < _layer_ms(cm, "vit", 8, 8192) / llm < 0.7
        # ... but a sequence of 48 images of 169 LLM tokens is 48 x 2704 patches in the ViT.
        assert _layer_ms(cm, "vit", 48, 48 * 2704) > 2 * llm
    # The paper's ratio is reached with a realistic image share (14 images of 52x52 patches).
    cm = CostModel(VLM_M.model, H800, shape=ParallelShape(tp=8))
    ratio = _layer_ms(cm, "vit", 14, 14 * 2704) / _layer_ms(cm, "llm", 1, 8192, 8 * 1024**2)
    assert 6.75 / 10.5 / 2 < ratio < 6.75 / 10.5 * 2


def test_attention_is_quadratic_in_segment_length() -> None:
    cm = CostModel(VLM_S.model, H100, shape=ParallelShape(tp=4))
    # Same 8192 tokens, longer documents: more attention work.
    times = [_layer_ms(cm, "llm", 1, 8192, (8192 // d) * d * d) for d in (512, 2048, 8192)]
    assert times[0] < times[1] < times[2]
    # Per-token cost of one sequence grows with its length once GEMMs are saturated.
    per_token = [_layer_ms(cm, "llm", 1, t) / t for t in (8192, 16384, 32768)]
    assert per_token[0] < per_token[1] < per_token[2]
    # The increase is linear in attention pairs: doubling the document length doubles it.
    base = _layer_ms(cm, "llm", 1, 32768, 32768 * 4096)
    d1 = _layer_ms(cm, "llm", 1, 32768, 32768 * 8192) - base
    d2 = _layer_ms(cm, "llm", 1, 32768, 32768 * 16384) - base
    assert d2 / d1 == pytest.approx(3.0, rel=0.05)
    # ViT: same patches in fewer, larger images cost more (default pairs = tokens^2 / instances).
    assert _layer_ms(cm, "vit", 4, 4 * 4096) > _layer_ms(cm, "vit", 16, 4 * 4096)


def test_window_attention_layers_are_priced_cheaper() -> None:
    """Qwen2.5-VL's window attention: a windowed ViT's attention core is priced at the mean
    pairs of its layers (full layers over each image, the others within windows of window^2
    patches), so big images cost less than under full attention, and images no bigger than a
    window cost the same."""
    from megatron_dip.modalities.costs import CostContext, Work
    from megatron_dip.modalities.vit import VIT

    model = VLM_S.model
    vit = model.module("vit")
    windowed = model.replace_module(
        "vit", arch={"window_size": 8 * vit.patch_size, "full_attention_layers": (7, 15, 23)}
    )
    full, cheap = CostModel(model, H100), CostModel(windowed, H100)
    assert _layer_ms(cheap, "vit", 4, 4 * 4096) < 0.9 * _layer_ms(full, "vit", 4, 4 * 4096)
    assert _layer_ms(cheap, "vit", 8, 8 * 64) == pytest.approx(_layer_ms(full, "vit", 8, 8 * 64))
    spec, c = windowed.module("vit"), CostContext(tp=1, sp=False, dt=2)
    (core,) = [o for o in VIT.layer_ops(spec, Work(4 * 4096, 4, 4 * 4096**2), c) if o.core]
    mean = (3 * 4 * 4096**2 + (vit.num_layers - 3) * 4 * 4096 * 64) / vit.num_layers
    assert core.flops == pytest.approx(4 * mean * vit.layer.attention_width)


def test_recompute_trades_time_for_memory() -> None:
    cm = CostModel(VLM_S.model, H100, shape=ParallelShape(tp=4), kernels=CPU_KERNELS)
    chunk, sub = ChunkSpec("llm", 1, 1, 4, 12), _sub("llm", 1, 8192, 8 * 1024**2)
    modes = (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL)
    none, sel, full = (cm.stage_cost(chunk, sub, MemoryPolicy(r)) for r in modes)
    assert none.forward == sel.forward == full.forward
    assert none.backward < sel.backward < full.backward
    assert full.backward == pytest.approx(none.backward + none.forward)
    assert none.activation_bytes > sel.activation_bytes > full.activation_bytes
    # Full recompute keeps the chunk's input message only: tokens x hidden x 2 bytes.
    assert full.activation_bytes == 8192 * 4096 * 2
    # SDPA per segment keeps each segment's output: selective recompute drops it (and the LSE).
    heads, tp = 32, 4
    core = 2 * 8192 * 4096 / tp + 4 * heads * 8192 / tp
    assert none.activation_bytes - sel.activation_bytes == pytest.approx(8 * core, rel=1e-9)
    # With flash attention only the log-sum-exp is dropped: selective saves almost nothing.
    flash = CostModel(VLM_S.model, H100, shape=ParallelShape(tp=4))
    f_none, f_sel = (
        flash.stage_cost(chunk, sub, MemoryPolicy(r)) for r in (Recompute.NONE, Recompute.SELECTIVE)
    )
    assert f_none.activation_bytes > f_sel.activation_bytes > 0.99 * f_none.activation_bytes
    assert f_none.activation_bytes < none.activation_bytes  # the kernel matters


@pytest.mark.parametrize("tokens", [2048, 8192, 16384])
def test_hidden_offload_layers_is_the_most_that_costs_nothing(tokens) -> None:
    """`hidden_offload_layers`: offloading that many layers (alone or after block 1) adds no
    time and leaves at most one layer's bytes on the device after the forward; one more does
    not (or the chunk has no more layers). The "drained" offer: the most that leave none;
    "chained": no more than the paced offer (paced reloads wait no longer than chained ones)."""
    cm = CostModel(VLM_S.model, H100, shape=ParallelShape(tp=4, sp=True))
    chunk, sub = ChunkSpec("llm", 1, 1, 4, 12), _sub("llm", 2, tokens, 2 * tokens**2)
    for recompute in (MemoryPolicy(Recompute.NONE, 0), MemoryPolicy(Recompute.BLOCK, 1)):
        n = recompute.layers
        base = cm.stage_cost(chunk, sub, recompute)
        k = cm.hidden_offload_layers(chunk, sub, recompute)
        assert 0 <= k <= chunk.num_layers - n
        free = cm.stage_cost(chunk, sub, recompute.with_offload(k))
        assert (free.forward, free.backward) == (base.forward, base.backward)
        if k < chunk.num_layers - n:
            more = cm.stage_cost(chunk, sub, recompute.with_offload(k + 1))
            layer = cm.offloaded_bytes(chunk, sub, recompute.with_offload(1))
            left = more.activation_bytes - (
                base.activation_bytes
                - cm.offloaded_bytes(chunk, sub, recompute.with_offload(k + 1))
            )
            assert more.backward > base.backward or left > layer
        # `drained`: no more than that, and the copy out of those ends within the forward.
        d = cm.hidden_offload_layers(chunk, sub, recompute, offer="drained")
        assert 0 <= d <= k
        if d:
            drained = cm.stage_cost(chunk, sub, recompute.with_offload(d))
            assert drained.copy_residual == 0 and drained.backward == base.backward
        if d < chunk.num_layers - n:
            more = cm.stage_cost(chunk, sub, recompute.with_offload(d + 1))
            assert more.copy_residual > 0 or more.backward > base.backward
        # "chained": no more than paced, and those cost nothing under the paced runtime.
        c = cm.hidden_offload_layers(chunk, sub, recompute, offer="chained")
        assert 0 <= c <= k
        chained = cm.stage_cost(chunk, sub, recompute.with_offload(max(c, 1)))
        assert not c or chained.backward == base.backward
    with pytest.raises(ValueError, match="offload offer"):
        cm.hidden_offload_layers(chunk, sub, offer="eager")


def test_offload_trades_host_link_time_for_device_memory() -> None:
    """Offloaded layers leave the device (all their stored bytes; a middle chunk's first layer
    keeps its received input, held anyway). As the runtime copies: the copy out (offload + the
    chunk's message, at the GPU's share of the shared host link) never delays the forward, but
    what it has not copied when the forward ends stays on the device; the first reload waits
    behind the backwards of the layers after the offloaded ones, the later ones queue behind it,
    each issued as the backward frees a layer after the offloaded ones (else as it reaches the
    offloaded layer after it)."""
    cm = CostModel(VLM_S.model, H100, shape=ParallelShape(tp=4, sp=True))
    chunk, sub = ChunkSpec("llm", 1, 1, 4, 12), _sub("llm", 2, 8192, 2 * 4096**2)
    none = cm.stage_cost(chunk, sub)
    block1 = cm.stage_cost(chunk, sub, MemoryPolicy(Recompute.BLOCK, 1))
    hidden = 2 * 8192 * 4096 / 4  # bf16, sequence parallel over TP4
    share, latency = H100.host_link_share, H100.p2p_latency
    # A layer's stored bytes: block 1 keeps only the first layer's input.
    per_layer = none.activation_bytes - block1.activation_bytes + hidden
    for k in (1, 2, 8):
        off = cm.stage_cost(chunk, sub, MemoryPolicy(Recompute.NONE, 0, k))
        moved = cm.offloaded_bytes(chunk, sub, MemoryPolicy(Recompute.NONE, 0, k))
        assert moved == pytest.approx(k * per_layer - hidden, rel=1e-6)
        link = (moved + hidden) / share + latency
        assert off.copy_out == pytest.approx(link)
        assert off.forward == none.forward  # the compute stream never waits for the copy out
        # A middle chunk of 8 layers: the copy out overlaps the forwards of the 7 layers after
        # the first offloaded one; the rest of its bytes are still on the device.
        left = moved * max(0.0, 1 - 7 * none.forward / 8 / link)
        assert off.activation_bytes == pytest.approx(none.activation_bytes - moved + left, abs=2)
        first = moved / k / share + hidden / share + latency
        assert off.reload == pytest.approx(first)
        assert off.reload_window == pytest.approx((8 - k) * none.backward / 8)
        stall = max(0.0, first - off.reload_window)
        layer, bwd_l = moved / k / share, none.backward / 8
        if k == 2:  # the second issued after one freed layer, queued behind the first
            reached = max(off.reload_window, first)
            later = max(0.0, max(bwd_l, first) + layer - (reached + bwd_l))
        else:  # one layer: none; the whole chunk: each issued as the backward reaches the next
            later = (k - 1) * max(0.0, layer - bwd_l)
        assert off.reload_stall == pytest.approx(stall)
        assert off.backward == pytest.approx(none.backward + stall + later)
    # One layer: its copy out outlasts the 7 later layers' forwards by ~1/8 of the chunk's
    # forward here, so ~1/8 of its bytes are still there when the forward ends; its reload
    # hides behind the later layers' backwards.
    one = cm.stage_cost(chunk, sub, MemoryPolicy(Recompute.NONE, 0, 1))
    assert block1.activation_bytes < one.activation_bytes < none.activation_bytes
    assert one.forward == none.forward and one.backward == none.backward < block1.backward
    # The whole chunk: the link is ~10x slower than the layers produce activations, so most of
    # its bytes are still on the device after the forward and the reloads wait.
    whole = cm.stage_cost(chunk, sub, MemoryPolicy(Recompute.NONE, 0, 8))
    assert whole.activation_bytes > 0.8 * none.activation_bytes
    assert whole.backward > 2 * none.backward
    # Block recompute of the first layer, then offload of the next: both savings.
    mixed = cm.stage_cost(chunk, sub, MemoryPolicy(Recompute.BLOCK, 1, 1))
    assert mixed.activation_bytes < block1.activation_bytes
    # Offloading the chunk's last layer (after block 7): its backward comes first, so nothing
    # overlaps the reload (the runtime prefetches when the chunk's backward starts).
    block7 = cm.stage_cost(chunk, sub, MemoryPolicy(Recompute.BLOCK, 7))
    last = cm.stage_cost(chunk, sub, MemoryPolicy(Recompute.BLOCK, 7, 1))
    moved = cm.offloaded_bytes(chunk, sub, MemoryPolicy(Recompute.BLOCK, 7, 1))
    exposed = (moved + hidden) / share + latency
    assert last.backward == pytest.approx(block7.backward + exposed)
    # Offload past the chunk's last layer (block recompute of all 8 first, as a uniform stock
    # setting can ask): nothing offloaded, nothing more kept.
    past = cm.stage_cost(chunk, sub, MemoryPolicy(Recompute.BLOCK, 8, 1))
    block8 = cm.stage_cost(chunk, sub, MemoryPolicy(Recompute.BLOCK, 8))
    assert past.copy_bytes == 0 and past.activation_bytes == block8.activation_bytes
    # A slower host link (A100: PCIe Gen4) makes the same reloads wait longer.
    slow = CostModel(VLM_S.model, get_device("a100"), shape=ParallelShape(tp=4, sp=True))
    assert H100.host_link_share == 2 * get_device("a100").host_link_share
    off4 = (c.stage_cost(chunk, sub, MemoryPolicy(Recompute.NONE, 0, 4)) for c in (cm, slow))
    base = (c.stage_cost(chunk, sub) for c in (cm, slow))
    (fast4, slow4), (fast0, slow0) = off4, base
    assert slow4.backward - slow0.backward > fast4.backward - fast0.backward > 0


def test_activation_memory_counts_what_the_layers_keep() -> None:
    """Per layer (bf16, flash attention, fused norms, ViT-5B: LayerNorm, GELU, 2-D rotary):
    both norms' inputs and stats, QKV input and output, rotary Q, K and their cos / sin tables,
    the out-projection input, fc1 input and output, fc2 input; the attention's log-sum-exp."""
    vit = PAPER_SETUPS["vlm-s"].model
    lay = vit.module("vit").layer
    s, h, a, d, f = 4096, lay.hidden, lay.heads, lay.head_dim, lay.ffn
    kv = 2 * lay.kv_groups * d / h
    got = CostModel(vit, H100).stage_cost(_mid("vit"), _sub("vit", 1, s)).activation_bytes
    units = 2 + 2 + (1 + kv) + (1 + kv / 2) + 1 + 2 * f / h  # replicated; QKV, Q/K, proj, MLP
    units += 4 * d / h + 2 * 2 * 4 / (2 * h)  # rotary tables; 2 fp32 stats of both norms
    want = 2 * s * h * units + 4 * a * s
    assert got == pytest.approx(want, rel=1e-9)
    tp = CostModel(vit, H100, shape=ParallelShape(tp=4))
    sp = CostModel(vit, H100, shape=ParallelShape(tp=4, sp=True))
    bytes_tp = tp.stage_cost(_mid("vit"), _sub("vit", 1, s)).activation_bytes
    bytes_sp = sp.stage_cost(_mid("vit"), _sub("vit", 1, s)).activation_bytes
    # Under SP everything but the rotary tables (applied on the gathered sequence) splits.
    tables = 2 * s * h * 4 * d / h
    assert bytes_sp == pytest.approx((got - tables) / 4 + tables, rel=1e-6)
    assert bytes_sp < bytes_tp < got


def test_tensor_parallel_divides_compute_and_adds_communication() -> None:
    one = CostModel(VLM_S.model, H100)
    four = CostModel(VLM_S.model, H100, shape=ParallelShape(tp=4))
    four_h800 = CostModel(VLM_S.model, H800, shape=ParallelShape(tp=4))
    t1, t4 = _layer_ms(one, "llm", 1, 8192), _layer_ms(four, "llm", 1, 8192)
    assert t1 / 4 < t4 < t1 / 2
    assert _layer_ms(four_h800, "llm", 1, 8192) > t4  # slower NVLink, same compute


def test_efficiency_is_monotone_and_saturating() -> None:
    cm = CostModel(VLM_S.model, H100, shape=ParallelShape(tp=4))
    for tokens in (256, 1024, 2704):
        curve = [
            cm.efficiency("vit", instances=b, tokens_per_instance=tokens) for b in range(1, 65)
        ]
        assert all(0 < e <= 1 for e in curve)
        assert all(a <= b + 1e-12 for a, b in zip(curve, curve[1:]))
        gains = [curve[2 * b - 1] - curve[b - 1] for b in (1, 2, 4, 8, 16, 32)]  # doublings
        assert gains[-3] > gains[-2] > gains[-1]  # an S-curve over log(size): flattening
        assert gains[-1] < 0.05 * curve[63] and curve[0] < 0.9 * curve[63]
        size = next(b for b, e in enumerate(curve, 1) if e >= 0.95 * max(curve))
        assert 1 < size < 48


def test_input_and_output_layers_are_charged_to_end_chunks() -> None:
    cm = CostModel(VLM_S.model, H100, shape=ParallelShape(tp=4))
    sub = _sub("llm", 1, 8192)
    first, mid, last = (
        cm.stage_cost(ChunkSpec("llm", i, 0, s, s + 1), sub) for i, s in ((0, 0), (1, 5), (2, 31))
    )
    assert first.forward > mid.forward and last.forward > mid.forward
    assert last.activation_bytes > mid.activation_bytes + 8192 * 128256 // 4 * 4 - 1  # fp32 logits
    # Llama3-8B: 6.98 B in its layers, 8.03 B with embedding and head.
    layers = sum(cm.chunk_params(ChunkSpec("llm", i, 0, i, i + 1)) for i in range(1, 31))
    total = cm.chunk_params(ChunkSpec("llm", 0, 0, 0, 32))
    assert layers == 30 * cm.layer_params("llm")
    assert total == pytest.approx(8.03e9, rel=0.01)
    assert 32 * cm.layer_params("llm") == pytest.approx(6.98e9, rel=0.01)


def test_dit_cross_attention_and_frozen_text_encoder() -> None:
    t2v = PAPER_SETUPS["t2v-s"]
    short = CostModel(t2v.model, H100, shape=ParallelShape(tp=4), caption_tokens=64)
    long = CostModel(t2v.model, H100, shape=ParallelShape(tp=4), caption_tokens=1024)
    assert _layer_ms(long, "dit", 4, 4 * 4096) > _layer_ms(short, "dit", 4, 4 * 4096)
    # A sub-microbatch that carries its clips' caption tokens is priced on them, whatever
    # caption_tokens (the fallback of per-module estimates) says.
    few, many = (
        replace(_sub("dit", 4, 4 * 4096), context_tokens=4 * n, context_pairs=4 * 4096 * n)
        for n in (64, 1024)
    )
    for cm in (short, long):
        assert cm.stage_cost(_mid("dit"), few) == short.stage_cost(_mid("dit"), few)
        assert cm.stage_cost(_mid("dit"), many) == long.stage_cost(_mid("dit"), many)
    assert short.stage_cost(_mid("dit"), many).forward > short.stage_cost(_mid("dit"), few).forward
    # The frozen text encoder runs forward only; the DiT forward and backward.
    text = short.stage_cost(ChunkSpec("text", 0, 0, 0, 32), _sub("text", 8, 8 * 256))
    assert short.module_time("text", instances=8, tokens=8 * 256) == pytest.approx(text.forward)
    dit = short.stage_cost(ChunkSpec("dit", 0, 0, 0, 28), _sub("dit", 2, 8192))
    assert short.module_time("dit", instances=2, tokens=8192) == pytest.approx(
        dit.forward + dit.backward
    )
    # A frozen LLM fed by a trainable vision module still needs its backward.
    tiny = CostModel(tiny_t2v(train_text=True), H100)
    whole = tiny.stage_cost(ChunkSpec("dit", 0, 0, 0, 8), _sub("dit", 1, 64))
    assert tiny.module_time("dit", instances=1, tokens=64) == pytest.approx(
        whole.forward + whole.backward
    )


def test_a_chunk_fed_by_data_alone_runs_its_whole_backward_as_w() -> None:
    """The runtime's split backward has no input gradient to compute for a chunk whose inputs
    need none (`runtime/backward_split.py`): its W is the whole backward and holds everything
    the forward kept. Which inputs need gradients: a ViT's first chunk none, its later ones
    yes; the LLM's first chunk only on a sub-microbatch with image rows from a trainable
    ViT."""
    cm = CostModel(VLM_S.model, H100, shape=ParallelShape(tp=4))
    vit0, vit1 = ChunkSpec("vit", 0, 0, 0, 8), ChunkSpec("vit", 1, 1, 8, 16)
    llm0 = ChunkSpec("llm", 0, 2, 0, 8)
    images = _sub("vit", 4, 4 * 1024)
    text = _sub("llm", 1, 4096)
    mixed = replace(text, input_tokens=1024)
    assert not cm.inputs_need_gradients(vit0, images) and cm.inputs_need_gradients(vit1, images)
    assert cm.inputs_need_gradients(llm0, mixed) and not cm.inputs_need_gradients(llm0, text)
    frozen = CostModel(VLM_S.model.replace_module("vit", trainable=False), H100)
    assert not frozen.inputs_need_gradients(llm0, mixed)
    first, later = cm.stage_cost(vit0, images), cm.stage_cost(vit1, images)
    assert first.weight == first.backward and first.backward_input == 0
    assert first.pending_weight_bytes == first.activation_bytes
    assert 0 < later.weight < later.backward
    assert later.pending_weight_bytes < later.activation_bytes
    for policy in (MemoryPolicy(Recompute.FULL), MemoryPolicy(Recompute.BLOCK, 4)):
        held = cm.stage_cost(vit0, images, policy)
        assert (
            held.pending_weight_bytes
            == held.activation_bytes
            == cm.weight_bytes(vit0, images, policy)
        )


def test_transformer_engines_queue_holds_every_linears_tensors_until_w() -> None:
    """Under Transformer Engine's delayed weight GEMMs (`Kernels.te_delayed_wgrad`) a pending W
    also holds the row-parallel linears' sharded inputs and gathered output gradients, and the
    column-parallel ones' gathered inputs (what TE's queue keeps), where our own split holds
    only the column-parallel ones' sequence-sharded inputs and output gradients; their weight
    GEMMs' time moves from B to W. Llama3-8B layers at TP4 with sequence parallelism."""
    shape = ParallelShape(tp=4, sp=True)
    local = CostModel(VLM_S.model, H100, shape=shape)
    te = CostModel(VLM_S.model, H100, shape=shape, kernels=Kernels(te_delayed_wgrad=True))
    chunk, sub = ChunkSpec("llm", 1, 1, 8, 12), _sub("llm", 1, 4096, 4096 * 512)
    layer, m, tp, dt = VLM_S.model.module("llm").layer, 4096, 4, 2
    h, f = layer.hidden, layer.ffn
    qkv = layer.attention_width + 2 * layer.kv_groups * layer.head_dim
    # Per layer, (input, output gradient) of QKV, out-projection, fc1 (SwiGLU: 2f), fc2.
    te_held = m * (
        (h + qkv / tp) + (layer.attention_width / tp + h) + (h + 2 * f / tp) + (f / tp + h)
    )
    local_held = m * ((h / tp + qkv / tp) + (h / tp + 2 * f / tp))
    extra = te.weight_bytes(chunk, sub) - local.weight_bytes(chunk, sub)
    assert extra == pytest.approx(chunk.num_layers * dt * (te_held - local_held), rel=1e-9)
    assert te.chunk_activation_bytes(chunk, sub) == local.chunk_activation_bytes(chunk, sub)
    a, b = local.stage_cost(chunk, sub), te.stage_cost(chunk, sub)
    assert a.backward == pytest.approx(b.backward)
    assert b.weight > a.weight and b.backward_input < a.backward_input


def test_transfer_time_is_latency_plus_bandwidth() -> None:
    cm = CostModel(VLM_S.model, H100)
    assert cm.transfer_time(0) == H100.p2p_latency
    assert cm.transfer_time(10**9) == pytest.approx(H100.p2p_latency + 10**9 / H100.ib_bandwidth)


def _profile(tmp_path, **changes) -> str:
    data = {
        "format": "megatron-dip-profile/1",
        "device": "H100",
        "software": {"torch": "2.6.0", "megatron_core": "0.16.1"},
        "attention": "flash-attn 2",
        "tensor_parallel": 4,
        "modules": {
            "llm": [
                {"tokens": 4096, "instances": 1, "forward_ms": 2.0, "backward_ms": 4.0},
                {"tokens": 8192, "instances": 1, "forward_ms": 4.0, "backward_ms": 9.0},
                {"tokens": 4096, "instances": 2, "forward_ms": 3.0, "backward_ms": 6.0},
                {"tokens": 8192, "instances": 2, "forward_ms": 6.0, "backward_ms": 14.0},
            ]
        },
    }
    data.update(changes)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_profile_is_preferred_and_interpolated(tmp_path) -> None:
    cm = CostModel(
        VLM_S.model, H100, shape=ParallelShape(tp=4), profile=load_profile(_profile(tmp_path))
    )
    analytic = CostModel(VLM_S.model, H100, shape=ParallelShape(tp=4))
    c = cm.stage_cost(_mid("llm"), _sub("llm", 1, 6144))
    assert (c.forward, c.backward) == pytest.approx((3.0e-3, 6.5e-3))
    # Two instances: per-instance times of the 2-instance measurements, times two.
    c2 = cm.stage_cost(_mid("llm"), _sub("llm", 2, 2 * 8192))
    assert (c2.forward, c2.backward) == pytest.approx((6.0e-3, 14.0e-3))
    # Beyond the measured tokens: the edge measurement scaled by the analytic model.
    big, edge = (analytic.stage_cost(_mid("llm"), _sub("llm", 1, t)).forward for t in (16384, 8192))
    assert cm.stage_cost(_mid("llm"), _sub("llm", 1, 16384)).forward == pytest.approx(
        4e-3 * big / edge, rel=1e-3
    )
    # The ViT is not covered: analytic.
    assert cm.stage_cost(_mid("vit"), _sub("vit", 4, 4096)) == analytic.stage_cost(
        _mid("vit"), _sub("vit", 4, 4096)
    )


def test_invalid_profile_names_file_and_field(tmp_path) -> None:
    bad_entry = {"llm": [{"tokens": 4096, "instances": 1, "forward_ms": -1, "backward_ms": 1}]}
    with pytest.raises(ValueError, match=r"profile\.json.*modules\.llm\[0\]\.forward_ms"):
        load_profile(_profile(tmp_path, modules=bad_entry))
    with pytest.raises(ValueError, match="'tensor_parallel'"):
        load_profile(_profile(tmp_path, tensor_parallel=0))
    with pytest.raises(ValueError, match="'format'"):
        load_profile(_profile(tmp_path, format="v0"))
    with pytest.raises(ValueError, match="tensor_parallel"):
        CostModel(
            VLM_S.model, H100, shape=ParallelShape(tp=8), profile=load_profile(_profile(tmp_path))
        )


def test_calibrated_copy_scales_one_module() -> None:
    cm = CostModel(VLM_S.model, H100, shape=ParallelShape(tp=4))
    cal = cm.calibrated({"vit": 1.5})
    sub = _sub("vit", 4, 4096)
    base, scaled = cm.stage_cost(_mid("vit"), sub), cal.stage_cost(_mid("vit"), sub)
    assert scaled.forward == pytest.approx(1.5 * base.forward)
    assert scaled.backward == pytest.approx(1.5 * base.backward)
    assert scaled.activation_bytes == base.activation_bytes
    llm = _sub("llm", 1, 8192)
    assert cal.stage_cost(_mid("llm"), llm) == cm.stage_cost(_mid("llm"), llm)
    with pytest.raises(ValueError, match="> 0"):
        cm.calibrated({"vit": 0.0})
    with pytest.raises(KeyError, match="nope"):
        cm.calibrated({"nope": 1.1})


def test_block_and_uniform_recompute_follow_megatron_s_rules() -> None:
    """Megatron's --recompute-method on one 8-layer stage (Korthikanti et al.): block N keeps
    the 2sbh-byte input of its first N layers and every activation of the others, and
    recomputes N layer forwards; uniform N keeps one input per group of N layers and recomputes
    every layer. What the chunk's layers share (positions, packed-sequence offsets) stays, as
    does the last chunk's head; only FULL (the whole chunk call recomputed) drops them."""
    cm = CostModel(VLM_S.model, H100, shape=ParallelShape(tp=4))
    chunk, sub = ChunkSpec("llm", 1, 1, 4, 12), _sub("llm", 1, 8192, 8 * 1024**2)
    none = cm.stage_cost(chunk, sub)
    layer_in = 8192 * 4096 * 2  # s * b * h * 2 bytes, replicated without sequence parallelism
    per_layer = none.activation_bytes - cm.chunk_activation_bytes(
        ChunkSpec("llm", 1, 1, 4, 11), sub
    )
    shared = none.activation_bytes - 8 * per_layer
    assert per_layer > layer_in and 0 <= shared < per_layer
    layer_fwd = none.forward / 8
    block3 = cm.stage_cost(chunk, sub, MemoryPolicy(Recompute.BLOCK, 3))
    assert block3.activation_bytes == pytest.approx(3 * layer_in + 5 * per_layer + shared, abs=8)
    assert block3.backward == pytest.approx(none.backward + 3 * layer_fwd)
    assert block3.forward == none.forward
    uniform3 = cm.stage_cost(chunk, sub, MemoryPolicy(Recompute.UNIFORM, 3))
    assert uniform3.activation_bytes == pytest.approx(3 * layer_in + shared, abs=8)  # 3 groups
    assert uniform3.backward == pytest.approx(none.backward + none.forward)
    full = cm.stage_cost(chunk, sub, MemoryPolicy(Recompute.FULL))
    assert full.activation_bytes == layer_in  # the received hidden state only
    uniform8 = cm.stage_cost(chunk, sub, MemoryPolicy(Recompute.UNIFORM, 8)).activation_bytes
    assert uniform8 == pytest.approx(full.activation_bytes + shared, abs=8)
    block8 = cm.stage_cost(chunk, sub, MemoryPolicy(Recompute.BLOCK, 8)).activation_bytes
    assert block8 == pytest.approx(8 * layer_in + shared, abs=8)
    # More recomputed layers hold less and take longer, between none and full.
    blocks = [cm.stage_cost(chunk, sub, MemoryPolicy(Recompute.BLOCK, n)) for n in range(1, 9)]
    assert all(a.activation_bytes > b.activation_bytes for a, b in zip(blocks, blocks[1:]))
    assert all(a.backward < b.backward for a, b in zip(blocks, blocks[1:]))
    assert (
        none.activation_bytes > blocks[0].activation_bytes and blocks[-1].backward <= full.backward
    )
    # The last chunk keeps its head's logits under the partial methods (layers only recomputed).
    last = ChunkSpec("llm", 3, 3, 24, 32)
    logits = cm.chunk_activation_bytes(last, sub) - none.activation_bytes
    assert logits > 0
    last_uniform = cm.stage_cost(last, sub, MemoryPolicy(Recompute.UNIFORM, 8)).activation_bytes
    assert last_uniform == pytest.approx(layer_in + shared + logits, abs=8)


@pytest.mark.parametrize(("module", "gated"), [("vit", False), ("llm", True)])
def test_module_recompute_frees_a_third_of_a_layer_for_a_few_percent(module, gated) -> None:
    """Cheap module recomputation (`MemoryPolicy.modules`) on VLM-S (TP4, sequence parallel):
    "layernorm" frees each pre-norm's output and statistics, "mlp_act" the activation's output
    (GELU: 1 FFN width; SwiGLU: 3 of its 5), together a third (ViT-5B) to a half (Llama3-8B) of
    a layer's bytes, for the norms' and activation's memory-bound passes again in backward:
    under an eighth of full recomputation's time per byte freed. Block N applies it to the layers
    it leaves; it does not apply to full or uniform recomputation."""
    cm = CostModel(VLM_S.model, H800, shape=ParallelShape(tp=4, sp=True))
    chunk, sub = ChunkSpec(module, 1, 1, 5, 9), _sub(module, 8, 8192, 8 * 1024**2)
    spec, tp = VLM_S.model.module(module), 4
    h, f, tokens = spec.layer.hidden, spec.layer.ffn, 8192
    none, full = cm.stage_cost(chunk, sub), cm.stage_cost(chunk, sub, MemoryPolicy(Recompute.FULL))
    both = ("layernorm", "mlp_act")
    got = {
        m: cm.stage_cost(chunk, sub, MemoryPolicy(Recompute.NONE, 0, 0, m))
        for m in (both[:1], both[1:], both)
    }
    freed = {m: none.activation_bytes - c.activation_bytes for m, c in got.items()}
    stat = 4 / (2 * h)  # one fp32 statistic per token, in bf16 hidden widths
    norm = 2 * 2 * tokens * h / tp * (1 + (1 if spec.arch.normalization == "RMSNorm" else 2) * stat)
    assert freed[both[:1]] == pytest.approx(4 * norm, rel=1e-3)
    assert freed[both[1:]] == pytest.approx(4 * 2 * tokens * (3 if gated else 1) * f / tp, rel=1e-6)
    assert freed[both] == pytest.approx(freed[both[:1]] + freed[both[1:]], abs=4)
    share = freed[both] / none.activation_bytes  # ViT-5B 37%, Llama3-8B 48%
    assert (0.3 if not gated else 0.45) < share < 0.55
    per_byte = (got[both].backward - none.backward) / freed[both]
    full_per_byte = (full.backward - none.backward) / (
        none.activation_bytes - full.activation_bytes
    )
    assert 0 < per_byte < full_per_byte / 8  # ViT-5B 8x, Llama3-8B 17x cheaper
    assert got[both].forward == none.forward
    block = cm.stage_cost(chunk, sub, MemoryPolicy(Recompute.BLOCK, 1))
    block_both = cm.stage_cost(chunk, sub, MemoryPolicy(Recompute.BLOCK, 1, 0, both))
    assert block.activation_bytes - block_both.activation_bytes == pytest.approx(
        3 * freed[both] / 4, abs=4
    )
    with pytest.raises(ValueError, match="full recomputes every layer"):
        MemoryPolicy(Recompute.FULL, 0, 0, both).check()
