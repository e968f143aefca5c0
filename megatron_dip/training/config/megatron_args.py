"""The flag sections Megatron-LM defines too (parallelism, model, architecture, training, data,
checkpoints, logging): frozen dataclasses whose fields are flags (`arg`: a dataclass field that
is also a flag, used by `arguments.DipArgs` too), composed into `arguments.TrainConfig`. Our own
`--dip-*` flags are `arguments.DipArgs`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

PRESET = " (default: from the --model preset)"


def arg(
    flag: str,
    default: Any,
    help: str,
    *,
    choices: Sequence[str] | None = None,
    megatron: bool = True,
) -> Any:
    """A dataclass field that is also a command-line flag."""
    meta = {"flag": flag, "help": help, "choices": choices, "megatron": megatron}
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class ParallelArgs:
    """Parallel sizes and data-parallel options (Megatron-LM's names)."""

    tensor_model_parallel_size: int | None = arg(
        "--tensor-model-parallel-size", None, "tensor-parallel size (TP)" + PRESET
    )
    pipeline_model_parallel_size: int | None = arg(
        "--pipeline-model-parallel-size", None, "pipeline-parallel size (PP)" + PRESET
    )
    num_virtual_stages_per_pipeline_rank: int | None = arg(
        "--num-virtual-stages-per-pipeline-rank",
        None,
        "model chunks per pipeline rank of Megatron's interleaved schedule (--dip-schedule "
        "interleaved; default: 2); DIP's start-up search chooses its own",
    )
    num_layers_per_virtual_pipeline_stage: int | None = arg(
        "--num-layers-per-virtual-pipeline-stage",
        None,
        "Megatron-LM's older form of the same: V = --num-layers / (PP x this), which must divide",
    )
    sequence_parallel: bool = arg(
        "--sequence-parallel",
        False,
        "Megatron sequence parallelism (with TP > 1: norms and dropout on sequence shards)",
    )
    use_distributed_optimizer: bool = arg(
        "--use-distributed-optimizer", False, "shard optimizer state over data parallelism"
    )
    overlap_grad_reduce: bool = arg(
        "--overlap-grad-reduce",
        False,
        "overlap the data-parallel gradient reduction with backward (DIP always starts each "
        "chunk's reduction at its last backward; the stock schedules get Megatron's DDP hooks, "
        "without the flag they reduce after the schedule)",
    )
    distributed_timeout_minutes: int | None = arg(
        "--distributed-timeout-minutes",
        None,
        "minutes every rank waits for rank 0's start-up sizing (the placement search, run "
        "once per job on rank 0) before it stops with an error naming the flag (default: "
        "--dip-comm-timeout-s, which bounds every wait after start-up)",
    )


@dataclass(frozen=True)
class ModelArgs:
    """Which model, its precision and its activation recomputation."""

    model: str | None = arg(
        "--model",
        None,
        "run preset: model, global batch, sequence length, data mixture and parallel sizes "
        "(tiny-vlm, tiny-t2v, vlm-s, vlm-m, vlm-l, t2v-s, t2v-l)",
        megatron=False,
    )
    num_layers: int | None = arg(
        "--num-layers", None, "layers of the loss module (LLM or DiT)" + PRESET
    )
    encoder_num_layers: int | None = arg(
        "--encoder-num-layers", None, "layers of the encoder (ViT or text encoder)" + PRESET
    )
    vocab_size: int | None = arg("--vocab-size", None, "text vocabulary size" + PRESET)
    bf16: bool = arg(
        "--bf16",
        False,
        "bfloat16 weights, activations and messages; Megatron's mixed-precision optimizer keeps "
        "fp32 master weights (GPUs and CPU)",
    )
    init_method_std: float = arg("--init-method-std", 0.02, "std of the normal weight init")
    recompute_granularity: str | None = arg(
        "--recompute-granularity",
        None,
        "recompute whole chunks ('full') or attention only ('selective'); the stock schedules "
        "apply it to every stage, DIP plans start from it and add per-chunk recomputation where "
        "--dip-memory-limit-gb needs it",
        choices=("full", "selective"),
    )
    recompute_method: str | None = arg(
        "--recompute-method",
        None,
        "with --recompute-granularity full: Megatron's partial recomputation inside every chunk: "
        "'block' recomputes its first --recompute-num-layers layers, 'uniform' recomputes all "
        "in groups of --recompute-num-layers layers (without: the whole chunk, input and output "
        "layers included)",
        choices=("uniform", "block"),
    )
    recompute_num_layers: int | None = arg(
        "--recompute-num-layers",
        None,
        "N of --recompute-method (default 1)",
    )
    calculate_per_token_loss: bool = arg(
        "--calculate-per-token-loss",
        False,
        "normalise the loss by all loss tokens of the global batch instead of per microbatch",
    )
    freeze_LM: bool = arg(  # noqa: N815 (Megatron-LM's flag name)
        "--freeze-LM", False, "no gradients for the LLM (Megatron-LM's multimodal flag)"
    )
    freeze_ViT: bool = arg(  # noqa: N815
        "--freeze-ViT", False, "no gradients for the vision encoder (Megatron-LM's multimodal flag)"
    )
    dip_freeze: str | None = arg(
        "--dip-freeze",
        None,
        "modules trained without gradients, MODULE,... (e.g. text for a T2V text encoder); "
        "the planner gives them forward segments only",
        megatron=False,
    )


@dataclass(frozen=True)
class ArchitectureArgs:
    """Layer shapes and architecture options (Megatron-LM's names; they apply to the loss module,
    the LLM or the DiT, as --num-layers does; other modules: --dip-arch), and the Hugging Face
    configs they can come from. Applied in this order: preset, --dip-hf-config, --dip-arch, the
    Megatron-LM flags."""

    hidden_size: int | None = arg("--hidden-size", None, "hidden size" + PRESET)
    ffn_hidden_size: int | None = arg("--ffn-hidden-size", None, "MLP hidden size" + PRESET)
    num_attention_heads: int | None = arg("--num-attention-heads", None, "attention heads" + PRESET)
    num_query_groups: int | None = arg(
        "--num-query-groups", None, "key/value groups (grouped-query attention)" + PRESET
    )
    kv_channels: int | None = arg(
        "--kv-channels", None, "size of one attention head (default: hidden / heads)"
    )
    rotary_base: float | None = arg("--rotary-base", None, "rotary base (theta)" + PRESET)
    use_rope_scaling: bool = arg(
        "--use-rope-scaling",
        False,
        "Llama 3.1's llama3 rope scaling (low/high frequency factors 1/4, original context "
        "8192, as Megatron-LM)",
    )
    rope_scaling_factor: float = arg("--rope-scaling-factor", 8.0, "factor of --use-rope-scaling")
    norm_epsilon: float | None = arg("--norm-epsilon", None, "epsilon of the norms" + PRESET)
    untie_embeddings_and_output_weights: bool = arg(
        "--untie-embeddings-and-output-weights",
        False,
        "separate LLM input embedding and output head (default: the preset's or the Hugging "
        "Face config's tie_word_embeddings; the paper presets are untied)",
    )
    add_qkv_bias: bool = arg(
        "--add-qkv-bias", False, "biases on the query/key/value projection (Qwen2; presets)"
    )
    dip_arch: str | None = arg(
        "--dip-arch",
        None,
        "per-module options MODULE.KEY=VALUE,... with KEY one of hidden-size, ffn-hidden-size, "
        "num-attention-heads, num-query-groups, kv-channels, rotary-base, norm-epsilon, "
        "add-qkv-bias, tie-embeddings, activation (gelu, quick_gelu, silu), patch-embedding "
        "(linear, conv3d), e.g. vit.norm-epsilon=1e-6,vit.activation=quick_gelu",
        megatron=False,
    )
    dip_hf_config: str | None = arg(
        "--dip-hf-config",
        None,
        "Hugging Face model folder(s) whose config.json gives module shapes and options: DIR "
        "(the modules it describes: a Llama/Qwen2 folder the LLM or text encoder) or "
        "MODULE=DIR,... (e.g. llm=DIR,text=DIR); tools/hf_checkpoint.py import reads their "
        "weights",
        megatron=False,
    )


@dataclass(frozen=True)
class TrainArgs:
    """Batch, optimizer and learning-rate schedule (Megatron-LM's names and defaults)."""

    micro_batch_size: int = arg(
        "--micro-batch-size",
        1,
        "samples are packed into sequences: a microbatch is ONE packed sequence, so this must be 1",
    )
    global_batch_size: int | None = arg(
        "--global-batch-size", None, "packed microbatches per iteration (all replicas)" + PRESET
    )
    seq_length: int | None = arg(
        "--seq-length", None, "tokens of a packed LLM sequence / caption budget" + PRESET
    )
    train_iters: int | None = arg("--train-iters", None, "iterations to train (required)")
    lr: float | None = arg("--lr", None, "peak learning rate (required)")
    min_lr: float = arg("--min-lr", 0.0, "learning rate at the end of the decay")
    lr_decay_style: str = arg(
        "--lr-decay-style",
        "linear",
        "learning-rate decay",
        choices=("constant", "linear", "cosine", "inverse-square-root"),
    )
    lr_warmup_iters: int = arg("--lr-warmup-iters", 0, "linear warm-up iterations")
    lr_decay_iters: int | None = arg(
        "--lr-decay-iters", None, "iterations of decay (default: --train-iters)"
    )
    weight_decay: float = arg("--weight-decay", 0.01, "AdamW weight decay")
    clip_grad: float = arg("--clip-grad", 1.0, "gradient-norm clipping (0: off)")
    adam_beta1: float = arg("--adam-beta1", 0.9, "AdamW beta1")
    adam_beta2: float = arg("--adam-beta2", 0.999, "AdamW beta2")
    adam_eps: float = arg("--adam-eps", 1e-8, "AdamW epsilon")
    seed: int = arg("--seed", 1234, "seed of weights, data order and diffusion noise")
    override_opt_param_scheduler: bool = arg(
        "--override-opt_param-scheduler",
        False,
        "on resume, the LR schedule of these flags (--lr, --min-lr, --lr-warmup-iters, "
        "--lr-decay-iters/--train-iters, --lr-decay-style, --weight-decay) replaces the "
        "checkpoint's; its iteration count is kept",
    )
    use_checkpoint_opt_param_scheduler: bool = arg(
        "--use-checkpoint-opt_param-scheduler",
        False,
        "on resume, keep the checkpoint's LR schedule whatever these flags say",
    )


@dataclass(frozen=True)
class DataArgs:
    """Tokenizer and data loading (Megatron-LM's names)."""

    tokenizer_type: str | None = arg(
        "--tokenizer-type",
        None,
        "HuggingFaceTokenizer: a local Hugging Face tokenizer (--tokenizer-model); default: the "
        "tiny presets' offline ByteTokenizer",
        choices=("ByteTokenizer", "HuggingFaceTokenizer"),
    )
    tokenizer_model: str | None = arg(
        "--tokenizer-model",
        None,
        "directory of the Hugging Face tokenizer (tokenizer.json, tokenizer_config.json), "
        "loaded offline",
    )
    tokenizer_prompt_format: str | None = arg(
        "--tokenizer-prompt-format",
        None,
        "how conversations become text: hf (the tokenizer's chat_template; the default when it "
        "has one), llama3, chatml, qwen2, plain (LLaVA-Pretrain's layout; the byte tokenizer's)",
        choices=("hf", "llama3", "chatml", "qwen2", "plain"),
    )
    make_vocab_size_divisible_by: int = arg(
        "--make-vocab-size-divisible-by",
        128,
        "pad the tokenizer's vocabulary to a multiple of this x TP (when --vocab-size is unset)",
    )
    num_workers: int = arg(
        "--num-workers",
        2,
        "Energon data: worker slots per data-parallel replica; a dataset's shards are split over "
        "DP x this many slots as Energon splits them over ranks and workers",
    )


@dataclass(frozen=True)
class CheckpointArgs:
    """Where checkpoints go and when."""

    save: str | None = arg("--save", None, "directory to save checkpoints into")
    load: str | None = arg("--load", None, "directory to resume from (its latest checkpoint)")
    save_interval: int | None = arg("--save-interval", None, "save every N iterations")
    ckpt_step: int | None = arg(
        "--ckpt-step", None, "with --load: this iteration's checkpoint instead of the latest"
    )
    no_load_optim: bool = arg(
        "--no-load-optim", False, "do not load optimizer state (nor the LR schedule)"
    )
    no_load_rng: bool = arg("--no-load-rng", False, "do not load RNG state")
    async_save: bool = arg(
        "--async-save",
        False,
        "write checkpoints in a background process while training continues (published, "
        "tracker included, once complete)",
    )
    ckpt_format: str = arg(
        "--ckpt-format",
        "torch_dist",
        "checkpoint format: Megatron-Core dist_checkpointing's torch_dist (the only one)",
        choices=("torch_dist",),
    )
    finetune: bool = arg(
        "--finetune",
        False,
        "load only the model weights of --load (or --pretrained-checkpoint): iteration, "
        "optimizer, RNG, data position and LR schedule start afresh (Megatron-LM)",
    )
    pretrained_checkpoint: str | None = arg(
        "--pretrained-checkpoint",
        None,
        "checkpoint directory to fine-tune from when --load holds no checkpoint yet (Megatron-LM: "
        "weights only, iteration 0); a resumed run loads --load",
    )
    dip_pretrained: str | None = arg(
        "--dip-pretrained",
        None,
        "per-module pretrained weights MODULE=DIR,... (e.g. vit=DIR,llm=DIR; checkpoints "
        "written by tools/hf_checkpoint.py import or by training), loaded as "
        "--pretrained-checkpoint is; modules not named keep their initialisation",
        megatron=False,
    )


@dataclass(frozen=True)
class LoggingArgs:
    """Log lines, evaluation and TensorBoard."""

    log_interval: int = arg("--log-interval", 100, "iterations between log lines")
    eval_interval: int | None = arg("--eval-interval", None, "iterations between evaluations")
    eval_iters: int = arg("--eval-iters", 100, "batches per evaluation (forward-only plans)")
    tensorboard_dir: str | None = arg(
        "--tensorboard-dir", None, "write TensorBoard scalars here (needs tensorboard)"
    )
