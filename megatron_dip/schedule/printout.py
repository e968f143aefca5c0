"""A readable text printout of a plan: a header line, then one line per rank.

Tokens (separated by spaces, in program order):

* `F vit0.3.1` — forward of module `vit`, chunk 0, on microbatch 3, sub-microbatch 1. The
  `.sub` part is left out when the module has a single sub-microbatch in that microbatch
  (`B llm2.3` is the backward of llm chunk 2 on microbatch 3). A recomputed forward carries a
  suffix: `F vit0.3.1:sel` (selective), `F vit0.3.1:full`, `:block2` / `:uniform2` (Megatron's
  block / uniform method over 2 layers); `:off3` says the saved tensors of 3 of its layers go
  to host memory (`F llm1.2:block1:off2`: block recompute of one layer, the next two offloaded);
  `:layernorm` / `:mlp_act` name cheap module recomputation (`F vit0.3:block1:layernorm:mlp_act`).
* `>act(r1)` / `>grad(r3)` — post the send of an activation / gradient to rank 1 / 3;
  `<act(r0)` / `<grad(r2)` — post the receive of one from rank 0 / 2. Consecutive sends and
  receives form one batch and are printed inside brackets: `[<act(r0) >grad(r0)]`.
* `W2` — wait for 2 posted operations.
* A split backward: `BI llm2.3` (input gradients) and `BW llm2.3` (weight gradients);
  `R llm2` starts the data-parallel gradient reduction of llm chunk 2.

Example: `r1: [<act(r0)] W1 F model1.0 [<act(r0) >act(r2)] W2 F model1.1 ...`
"""

from __future__ import annotations

from collections import Counter

from .ir import (
    Backward,
    BackwardWeight,
    Forward,
    Instruction,
    Plan,
    Recompute,
    Recv,
    ReduceGrads,
    Send,
    StageId,
    Wait,
    compute_tag,
)

_RECOMPUTE_SUFFIX = {
    Recompute.NONE: "",
    Recompute.SELECTIVE: ":sel",
    Recompute.FULL: ":full",
    Recompute.BLOCK: ":block",
    Recompute.UNIFORM: ":uniform",
}


def _stage_token(stage: StageId, split: set[tuple[str, int]]) -> str:
    text = f"{stage.module}{stage.chunk}.{stage.microbatch}"
    if (stage.module, stage.microbatch) in split:
        text += f".{stage.sub}"
    return text


def _token(ins: Instruction, split: set[tuple[str, int]]) -> str:
    if isinstance(ins, Forward):
        memory = ins.memory
        layers = str(memory.layers) if memory.layers else ""
        offload = f":off{memory.offload}" if memory.offload else ""
        offload += "".join(f":{m}" for m in memory.modules)
        suffix = _RECOMPUTE_SUFFIX[memory.method]
        return f"F {_stage_token(ins.stage, split)}{suffix}{layers}{offload}"
    if isinstance(ins, (Backward, BackwardWeight)):
        return f"{compute_tag(ins)} {_stage_token(ins.stage, split)}"
    if isinstance(ins, ReduceGrads):
        return f"R {ins.module}{ins.chunk}"
    if isinstance(ins, (Send, Recv)):
        arrow = ">" if isinstance(ins, Send) else "<"
        return f"{arrow}{ins.key.kind.value}(r{ins.peer})"
    if isinstance(ins, Wait):
        return f"W{len(ins.keys)}"
    return repr(ins)


def format_program(plan: Plan, rank: int) -> str:
    """One rank's line of `format_plan`, without the `rN: ` prefix."""
    counts = Counter((s.module, s.microbatch) for s in plan.submicrobatches)
    split = {mm for mm, n in counts.items() if n > 1}
    tokens: list[str] = []
    batch: list[str] = []
    for ins in plan.programs[rank].instructions:
        if isinstance(ins, (Send, Recv)):
            batch.append(_token(ins, split))
            continue
        if batch:
            tokens.append("[" + " ".join(batch) + "]")
            batch = []
        tokens.append(_token(ins, split))
    if batch:
        tokens.append("[" + " ".join(batch) + "]")
    return " ".join(tokens)


def format_plan(plan: Plan) -> str:
    """Header line (name, iteration, replica, ranks, microbatches) and one line per rank."""
    mode = "forward only" if plan.forward_only else "forward+backward"
    header = (
        f"plan {plan.name!r} iteration {plan.iteration} replica {plan.replica}: "
        f"{plan.num_ranks} ranks, {len(plan.microbatches)} microbatches, "
        f"{len(plan.submicrobatches)} sub-microbatches, {mode}"
    )
    width = len(str(plan.num_ranks - 1))
    lines = [header] + [f"r{r:<{width}}: {format_program(plan, r)}" for r in range(plan.num_ranks)]
    return "\n".join(lines)
