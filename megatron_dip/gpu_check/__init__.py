"""The checks that only a GPU can answer, on one GPU, in one command (`scripts/gpu_check.sh`).

    python -m megatron_dip.gpu_check --out OUT_DIR [--iterations 5] [--profiles DIR]

1. Training: tiny-vlm and tiny-t2v, --bf16, one rank, a few iterations, once with the GPU
   attention (Transformer Engine's THD attention when it imports, else torch's FlashAttention
   varlen kernel: `--dip-attention auto`) and once with our CPU attention (SDPA per segment:
   `--dip-attention segments`): the losses must agree within 2% (relative) at every iteration.
2. Memory: every chunk of the two models (first / middle / last chunk of each module), bf16,
   each recompute mode, through the reference pipeline (`memory_probe`): the cost model's
   prediction for the kernels that run next to what autograd saved, the allocator's growth
   over the forward (`torch.cuda.memory_allocated`) and its peak (`max_memory_allocated`).
3. Executor overhead: the GPU-attention tiny-vlm run's per-instruction CUDA-event timeline
   (`--dip-trace-dir`) against the host's schedule time (`--dip-metrics-json`): device-busy
   time, the gaps between consecutive instructions and the host time not covered by them.
4. Offload: the copies of activation offload (`runtime/offload.py`, pinned host buffers on a
   side stream) timed with CUDA events against a chain of matrix products, alone and together
   (`offload_probe.transfer_overlap`): host-link bandwidth per direction and the overlap. The
   memory part (2) also runs the offload policies (one layer offloaded, alone and after block
   recomputation): the allocator's growth then shows what offload left on the device.
5. Layer profile: a summary of the profiles `scripts/profile_gpu.sh` wrote into `--profiles`
   (VLM-S layers at TP4), next to the analytic cost model's times for the same points.
6. Split backward: the first model trained in fp32 with every backward split into B and W
   (`--dip-split-backward --dip-split-backward-always`; with Transformer Engine >= 2.3 its
   layers queue their weight GEMMs for `backward_dw`, `runtime/delayed_wgrad.py`) against
   the same run with fused backwards: losses and gradient norms must agree within 1e-4
   (relative; the same arithmetic, summed in another order).
7. Pending W: the first model's chunks (first / middle / last of each module) built as part 6
   builds them, each backward split through the reference pipeline (`memory_probe.
   measure_pending_weights`): the bytes W releases on the device (the allocator's drop, with
   the weight gradients it allocates added back, plus the received messages), what the
   saved-tensor hooks see, and `CostModel.weight_bytes` priced for the kernels that run
   (Transformer Engine's weight-GEMM queue where it queues). On CUDA the middle chunks must be
   within 15% of the model.

It prints one table and writes `OUT_DIR/gpu_check.json`; each part that fails is reported with
its error and the others still run; the exit status is 1 when any part failed or a check did
not hold. On a machine without CUDA the same code runs on the CPU (the tests run it so): the
"GPU attention" is then SDPA per segment too and the times are host times.
"""

from .command import main, run_checks

__all__ = ["main", "run_checks"]
