"""`ParallelShape`: the run's parallel sizes as one frozen value (torch-free, no imports of ours).

Every derivation from the sizes lives here, once: the world size (TP x CP x DP x PP), whether
sequence parallelism is in effect (asked for and TP > 1), a rank's share of a sequence. The
checks of the sizes live here too, each error starting with the flag to change (`ShapeError`,
a ValueError; the training's flag checks re-raise it as their ConfigError).
"""

from __future__ import annotations

from dataclasses import dataclass

# The flag each size comes from, for errors.
FLAGS = {
    "tp": "--tensor-model-parallel-size",
    "cp": "--context-parallel-size",
    "pp": "--pipeline-model-parallel-size",
    "dp": "the world size",
    "vp": "--num-virtual-stages-per-pipeline-rank",
    "sp": "--sequence-parallel",
    "seq_length": "--seq-length",
}
DTYPES = ("float32", "bfloat16", "float16", "float64")


class ShapeError(ValueError):
    """Parallel sizes that cannot run; the message starts with the flag to change."""


def _fail(flag: str, message: str) -> ShapeError:
    return ShapeError(f"{flag}: {message}")


def sequence_parallel_in_effect(sp: bool, tp: int) -> bool:
    """Whether --sequence-parallel (`sp`) shards activations at tensor-parallel size `tp`: only
    with tensor parallelism (Megatron refuses it at TP=1). The one place this is decided."""
    return bool(sp) and tp > 1


@dataclass(frozen=True)
class ParallelShape:
    """The parallel sizes of one run, identical on every rank.

    `tp`, `cp`, `dp`, `pp`: tensor-, context-, data- and pipeline-parallel sizes (the world is
    their product, ranks ordered tp-cp-dp-pp, see `grid`). `vp`: virtual pipeline stages per rank
    of Megatron's interleaved schedule (None: not interleaved). `sp`: --sequence-parallel as asked
    for; `sequence_parallel` says whether it is in effect. `dtype`: the activations' dtype name.
    `seq_length`: tokens of one packed microbatch (None where no sequence is involved).
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    vp: int | None = None
    sp: bool = False
    dtype: str = "float32"
    seq_length: int | None = None

    def __post_init__(self) -> None:
        for name in ("tp", "cp", "pp", "dp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise _fail(FLAGS[name], f"must be an integer >= 1, got {value!r}")
        if self.cp != 1:
            raise _fail(FLAGS["cp"], f"context parallelism is not supported yet (got {self.cp})")
        if self.vp is not None and self.vp < 1:
            raise _fail(FLAGS["vp"], f"virtual pipeline stages must be >= 1, got {self.vp}")
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown activation dtype {self.dtype!r} (one of {DTYPES})")
        if self.seq_length is not None and self.seq_length < 1:
            raise _fail(FLAGS["seq_length"], f"must be >= 1, got {self.seq_length}")

    @classmethod
    def for_world(cls, world_size: int, *, tp: int = 1, pp: int = 1, cp: int = 1, **rest):
        """The shape filling `world_size` processes: DP = world / (TP x CP x PP); an error
        naming the size flags when they do not divide the world."""
        for name, value in (("tp", tp), ("cp", cp), ("pp", pp)):
            if value < 1:
                raise _fail(FLAGS[name], f"must be >= 1, got {value}")
        model = tp * cp * pp
        if world_size % model:
            flags = f"{FLAGS['tp']}/{FLAGS['pp']}" + (f"/{FLAGS['cp']}" if cp > 1 else "")
            sizes = f"TP x PP = {tp} x {pp}" if cp == 1 else f"TP x CP x PP = {tp} x {cp} x {pp}"
            raise _fail(flags, f"world size {world_size} is not divisible by {sizes} = {model}")
        return cls(tp=tp, pp=pp, cp=cp, dp=world_size // model, **rest)

    @property
    def world_size(self) -> int:
        """Processes of the run: TP x CP x DP x PP."""
        return self.tp * self.cp * self.dp * self.pp

    @property
    def model_parallel(self) -> int:
        """Processes holding one replica of the model (TP x CP x PP)."""
        return self.tp * self.cp * self.pp

    @property
    def sequence_parallel(self) -> bool:
        """Activations sharded along the sequence over TP: asked for, and TP > 1."""
        return sequence_parallel_in_effect(self.sp, self.tp)

    @property
    def sequence_split(self) -> int:
        """Ranks one sequence's activations are split over between layers (1: none)."""
        return (self.tp if self.sequence_parallel else 1) * self.cp

    def sequence_shard(self, tokens: int) -> int:
        """Tokens of one rank's share of a `tokens`-long (padded) sequence."""
        split = self.sequence_split
        if tokens % split:
            raise ValueError(
                f"{tokens} padded tokens do not divide by tensor parallel size {self.tp} "
                "under sequence parallelism: pad sub-microbatches to a multiple of it"
            )
        return tokens // split

    def check_sequence_parallel(self) -> None:
        """--sequence-parallel needs TP > 1 and a --seq-length TP divides."""
        if not self.sp:
            return
        if self.tp == 1:
            raise _fail(FLAGS["sp"], "needs tensor parallelism (TP > 1)")
        if self.seq_length is not None and self.seq_length % self.tp:
            raise _fail(
                FLAGS["sp"],
                f"--seq-length {self.seq_length} must be a multiple of TP={self.tp} "
                "(the sequence is split over the tensor-parallel ranks)",
            )

    def replace(self, **changes) -> ParallelShape:
        """A copy with `changes` (checked again)."""
        from dataclasses import replace

        return replace(self, **changes)


# One process, fp32, no parallelism: the default of whoever is not told a shape.
ONE_PROCESS = ParallelShape()
