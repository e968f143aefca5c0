"""Run presets: a name fixes the model AND the batch it is measured on.

A speedup only means something together with its batch, so `--model NAME` sets the global batch
(packed microbatches), the sequence length, the data mixture and its scaling, the parallel sizes
and the sub-microbatch sizes; every one of them can still be overridden by its own flag.
The paper's setups (`modelspec.PAPER_SETUPS`, docs/design.md, "Paper setups") are named like the paper
(plus `omni-s`: VLM-S with a Whisper-large-sized audio encoder); `tiny-vlm` / `tiny-t2v` /
`tiny-omni` are the CPU quick-start and test runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_dip.models.presets import model_preset
from megatron_dip.modelspec import PAPER_SETUPS, MultimodalSpec


@dataclass(frozen=True)
class RunPreset:
    """Defaults of one named run (see the module docstring)."""

    name: str
    global_batch_size: int  # packed microbatches per iteration, all replicas
    seq_length: int
    data: str
    data_scale: float = 1.0
    image_size: int | None = None
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    sub_microbatch_size: str | None = None  # None: chosen from the cost model
    segments: str | None = None  # None: from the cost model
    description: str = ""

    def model(self) -> MultimodalSpec:
        """The preset's model (before --num-layers / --encoder-num-layers / --vocab-size)."""
        return model_preset(self.name)


_PAPER_DATA = {"vlm": "synthetic-mixed", "t2v": "synthetic-t2v", "omni": "synthetic-omni"}


def _paper(name: str) -> RunPreset:
    setup = PAPER_SETUPS[name]
    shape = setup.shape
    return RunPreset(
        name=name,
        global_batch_size=setup.global_batch_microbatches,
        seq_length=setup.seq_length,
        data=_PAPER_DATA[name.split("-", maxsplit=1)[0]],
        tensor_parallel=shape.tp,
        pipeline_parallel=shape.pp,
        description=f"{setup.model.name}, TP{shape.tp} PP{shape.pp} "
        f"on {shape.world_size} GPUs in the paper",
    )


RUN_PRESETS: dict[str, RunPreset] = {
    "tiny-vlm": RunPreset(
        name="tiny-vlm",
        global_batch_size=8,
        seq_length=128,
        data="synthetic-mixed",
        data_scale=1 / 32,
        image_size=32,
        sub_microbatch_size="vit=2",
        segments="vit=1,llm=2",
        description="8+8-layer VLM, hidden 32: CPU quick start and tests",
    ),
    "tiny-t2v": RunPreset(
        name="tiny-t2v",
        global_batch_size=4,
        seq_length=64,
        data="synthetic-t2v",
        data_scale=1 / 64,
        sub_microbatch_size="text=2,dit=2",
        segments="text=1,dit=2",
        description="8+8-layer text encoder + DiT, hidden 32: CPU tests",
    ),
    "tiny-omni": RunPreset(
        name="tiny-omni",
        global_batch_size=8,
        seq_length=128,
        data="synthetic-omni",
        data_scale=1 / 32,
        image_size=32,
        sub_microbatch_size="vit=2,audio=2",
        segments="vit=1,audio=1,llm=2",
        description="4-layer ViT + 4-layer audio encoder + 8-layer LLM, hidden 32: CPU tests",
    ),
    **{name: _paper(name) for name in PAPER_SETUPS},
}


def get_run_preset(name: str) -> RunPreset:
    """The preset `name`; KeyError listing the known names."""
    try:
        return RUN_PRESETS[name]
    except KeyError:
        raise KeyError(f"unknown preset {name!r}; known: {', '.join(RUN_PRESETS)}") from None
