"""The training loop: plan, run, step, log, evaluate, checkpoint.

Per iteration, on every rank: rank 0 hands the next --dip-lookahead batches to the planner process;
the batch is taken from the `BatchStream`; its plan comes from the planner (or inline, counted);
the rank loads only the samples of its replica's microbatches, runs its program on the executor
(or Megatron-Core's stock schedule for --dip-schedule 1f1b|interleaved), gathers the global loss and
timings, steps the optimizer and the LR schedule. Before the first iteration every pipeline
communication path is warmed up once.

Every blocking step runs as a named phase of `ctx.watch` (`runtime.stalls.PhaseWatch`): when a
rank stalls or dies, every other rank stops within --dip-comm-timeout-s plus a few seconds with
one line naming the phase, its group, the ranks that did and did not arrive and the rank that
stalled.

Calibration: each iteration's gathered per-module measured and predicted compute times feed
`planner.calibration.Calibration` (all but the process's first, warm-up iteration); at the end of
every --dip-calibration-window iterations the new
scale factors go to the planners (`DipPlans.calibrate`) unless --dip-calibration-frozen. The log
shows the cost model's error on the iterations it predicted.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from dataclasses import dataclass, field

import torch.distributed as dist

from megatron_dip.planner.calibration import Calibration
from megatron_dip.planner.simulator import simulate
from megatron_dip.runtime.errors import StallError

from ..assembly.backend import select_backend
from ..assembly.build import LocalModel, build_model
from ..assembly.optim import build_optimizer, build_scheduler
from ..assembly.setup import ParallelContext, initialize, pipeline_peers, warm_up_pipeline
from ..checkpoint import state as checkpoint
from ..checkpoint.dirs import CheckpointError, newer_than
from ..checkpoint.finetune import load_pretrained
from ..checkpoint.save_lock import SaveLockedError, hold_save_lock
from ..checkpoint.storage import CheckpointWriter
from ..config.data_source import load_agreed, make_stream
from ..config.run import RunSpec
from .log import IntervalLog, IterationRecord, append_record, write_trace
from .metrics import batch_tokens, gather_stats, model_flops, predicted_ops
from .nonfinite import NonFiniteError, NonFiniteStreak, finite, resume_advice
from .planning import DipPlans, StockPlans
from .step import DipStep, StepResult, finish_stock_gradients, run_stock

logger = logging.getLogger("megatron_dip.training")


@dataclass
class TrainResult:
    """What a run returns on every rank (tests and tools read it)."""

    losses: dict[int, float] = field(default_factory=dict)  # completed iteration -> lm loss
    grad_norms: dict[int, float] = field(default_factory=dict)  # before clipping
    eval_losses: dict[int, float] = field(default_factory=dict)
    seconds: dict[int, float] = field(default_factory=dict)
    consumed: dict[int, int] = field(default_factory=dict)  # completed iteration -> samples
    planned: dict[int, float] = field(default_factory=dict)  # rank 0, logged iterations
    bound_efficiency: dict[int, float] = field(default_factory=dict)
    variants: Counter = field(default_factory=Counter)
    first_iteration: int = 0
    last_iteration: int = 0
    checkpoints: list[str] = field(default_factory=list)
    cost_error: dict[int, float] = field(default_factory=dict)  # calibrated model vs measured
    cost_ratio: dict[int, float] = field(default_factory=dict)  # calibrated predicted / measured
    plan_calibration: dict[int, int] = field(default_factory=dict)  # version each plan used
    calibration: dict = field(default_factory=dict)  # state at the end of the run


class Trainer:
    """One run on this rank (module docstring)."""

    def __init__(self, spec: RunSpec, ctx: ParallelContext) -> None:
        self.spec, self.ctx = spec, ctx
        # The planner process starts first and, in a fresh run, gets the first batches at once:
        # it imports and plans them while the model is built (a resumed run's stream position
        # is known only once the checkpoint is loaded: `run` hands its batches over then).
        self.plans = DipPlans(spec, ctx) if not spec.is_stock else None
        self.stream = self._stream(evaluation=False)
        if self.plans is not None and spec.resume is None:
            self.plans.ahead(self.stream)
        self.stock = StockPlans(spec) if spec.is_stock else None
        # Real or emulated compute (--dip-emulate-compute): chosen here, once.
        self.backend = select_backend(spec)
        self.model: LocalModel = build_model(spec, ctx, backend=self.backend)
        self.dip = DipStep(spec, ctx, self.model, self.backend) if self.plans is not None else None
        self.optimizer = build_optimizer(self.model, spec=spec, ctx=ctx)
        self.scheduler = build_scheduler(self.optimizer, spec=spec)
        self.eval_stream = None
        self.calibration = Calibration(
            window=spec.runtime.calibration_window, frozen=spec.runtime.calibration_frozen
        )
        self.iteration = 0
        self.consumed = 0
        self.blanked = 0  # samples trained as blank stand-ins (`_blank_samples`), all ranks
        self.named_bad: set[str] = set()
        self.result = TrainResult()
        self.nonfinite = NonFiniteStreak(spec.runtime.max_nonfinite_iters)
        self.writer = None
        if spec.checkpointing.save:
            self.writer = CheckpointWriter(
                group=ctx.dp,
                async_save=spec.checkpointing.async_save,
                timeout_s=spec.runtime.comm_timeout_s,
                verify=True,  # published once the next iteration trains finitely on them
            )
        self.loaded: tuple | None = None  # (path, iteration) of the checkpoint --load read
        self.loaded_finite: bool | None = None  # its weights' first iteration was finite
        self.modules = [m.name for m in spec.model.modules]
        self.plan_wait = 0.0  # seconds the last iteration waited for its plan (metrics)
        self.log = IntervalLog(
            train_iters=spec.training.iterations,
            world_size=ctx.world_size,
            global_batch=spec.training.global_batch_size,
            tensorboard_dir=spec.reporting.tensorboard_dir if ctx.is_logging_rank else None,
        )

    def _stream(self, *, evaluation: bool):
        t = self.spec.training
        return make_stream(
            self.spec.data,
            self.spec.model,
            seed=t.seed,
            global_batch_size=t.global_batch_size,
            limits=self.spec.limits,
            evaluation=evaluation,
        )

    # -- checkpoints ----------------------------------------------------------------------

    def load(self) -> None:
        c, resume = self.spec.checkpointing, self.spec.resume
        if resume is None and self.spec.pretrained:
            self._load_pretrained()
            return
        if resume is None:
            # Megatron-LM's auto-resume idiom (--save DIR --load DIR): a job's first run (other
            # --load that does not exist: refused by validation).
            if self.ctx.is_logging_rank:
                logger.warning("--load %s: no checkpoint there yet: starting from scratch", c.load)
            return
        with self.ctx.watch.phase("checkpoint load"):
            restored = checkpoint.load(
                resume.path,
                spec=self.spec,
                ctx=self.ctx,
                model=self.model,
                optimizer=self.optimizer,
                scheduler=self.scheduler,
            )
        self.iteration = restored.iteration
        self.loaded = (resume.path, resume.iteration)
        self.consumed = restored.consumed_samples
        try:  # validation compared the data flags; this names any other change in one line
            if restored.stream is not None:
                self.stream.load_state_dict(restored.stream)
            if restored.eval_stream is not None:  # evaluation continues where it stopped
                self.eval_stream = self._stream(evaluation=True)
                self.eval_stream.load_state_dict(restored.eval_stream)
        except ValueError as e:
            raise CheckpointError(
                f"{resume.path}: its data position cannot continue in this run ({e}); resume "
                "with the data flags it was saved with, or --finetune to take its weights only"
            ) from None
        if restored.calibration is not None:
            self.calibration.load_state_dict(restored.calibration)
        if self.plans is not None:  # frozen or not, plan with the restored factors
            cal = self.calibration
            self.plans.calibrate(version=cal.version, scales=cal.scales)
        later = newer_than(c.save, self.iteration) if c.save else []
        if later and self.ctx.is_logging_rank:
            logger.warning(
                "--save %s: resuming from iteration %d; the newer checkpoints %s there are "
                "replaced when this run reaches them",
                c.save,
                self.iteration,
                later,
            )

    def _load_pretrained(self) -> None:
        """Weights only (`finetune`): iteration 0, fresh optimizer, schedule and data."""
        load_pretrained(
            self.spec.pretrained,
            model=self.spec.model,
            chunks=self.model.inner,
            data_parallel_rank=self.ctx.dp_rank,
        )
        if hasattr(self.optimizer, "reload_model_params"):
            self.optimizer.reload_model_params()  # Megatron: fp32 masters from the new weights

    def save(self) -> None:
        with self.ctx.watch.phase("checkpoint save"):
            self._save()

    def _save(self) -> None:
        checkpoint.save(
            self.spec.checkpointing.save,
            iteration=self.iteration,
            spec=self.spec,
            ctx=self.ctx,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            stream_state=self.stream.state_dict(),
            calibration=self.calibration.state_dict(),
            consumed_samples=self.consumed,
            eval_stream_state=None if self.eval_stream is None else self.eval_stream.state_dict(),
            writer=self.writer,
        )

    # -- one iteration --------------------------------------------------------------------

    def _forward_backward(self, stream, *, evaluation: bool) -> tuple:
        spec, ctx, watch = self.spec, self.ctx, self.ctx.watch
        if self.plans is not None and not evaluation:
            self.plans.ahead(stream)
        batch = next(stream)
        asked = time.perf_counter()
        with watch.phase("plan fetch", group_name="plan store of rank 0, world"):
            if self.plans is None:
                plan, variant = self.stock.plan(batch, ctx.dp_rank), spec.schedule
            elif evaluation:
                plan, variant = self.plans.eval_plan(batch), "eval"
            else:
                plan, variant = self.plans.plan(batch)
        self.plan_wait = time.perf_counter() - asked
        # Every rank agrees that its samples loaded before any of them enters the pipeline.
        with watch.phase("sample agreement"):
            samples = load_agreed(
                lambda: self.backend.samples_for(stream, batch, plan),
                batch=batch,
                rank=ctx.rank,
                device=ctx.device,
                wait=watch.wait,
            )
        with watch.phase("pipeline schedule", group=ctx.pp, group_name="pipeline group"):
            if self.dip is None:
                result = run_stock(
                    spec, ctx, self.model, self.backend, plan, samples, forward_only=evaluation
                )
            else:
                result = self.dip.run(plan, samples)
        predicted = predicted_ops(plan, spec.cost_model, result.ops)
        blanked = self._blank_samples(samples)
        with watch.phase("stats gather"):
            stats = gather_stats(
                ctx, result, modules=self.modules, predicted=predicted, blanked=blanked
            )
        return batch, plan, variant, result, stats

    def _blank_samples(self, samples: dict[int, list]) -> int:
        """This replica's samples that failed to decode and run as blank stand-ins with no
        loss (--dip-bad-samples skip; `Sample.bad`), each named once; counted on the replica's
        first rank only (every rank of the replica loads them)."""
        if self.ctx.pp_rank != 0 or self.ctx.tp_rank != 0:
            return 0
        bad = [s for mb in samples.values() for s in mb if getattr(s, "bad", None)]
        for s in bad:
            if s.bad not in self.named_bad:
                self.named_bad.add(s.bad)
                logger.warning(
                    "skipping sample %s: %s; it trains as a blank of its planned shape with no "
                    "loss (--dip-bad-samples %s)",
                    s.sample_id,
                    s.bad,
                    self.spec.data.bad_samples,
                )
        return len(bad)

    def train_step(self) -> None:
        started = time.time()
        self.ctx.watch.iteration = self.iteration + 1
        self.model.zero_grad()
        self.optimizer.zero_grad()
        batch, plan, variant, result, stats = self._forward_backward(self.stream, evaluation=False)
        if self.spec.is_stock:
            finish_stock_gradients(self.spec, self.model, stats.loss_tokens)
        with self.ctx.watch.phase("optimizer step", group=self.ctx.mp, group_name="model group"):
            ok, norm, _ = self.optimizer.step()
        self.scheduler.step(1)
        self._calibrate(stats)
        self.iteration += 1
        self.consumed += batch.num_samples
        self.blanked += stats.blanked
        seconds = time.time() - started
        it = self.iteration
        r = self.result
        r.losses[it], r.seconds[it] = stats.loss, seconds
        r.consumed[it] = self.consumed
        if norm is not None:
            r.grad_norms[it] = float(norm)
        r.variants[variant] += 1
        bound = stats.max_busy / max(stats.max_duration, 1e-9)
        r.bound_efficiency[it] = bound
        if not ok:
            logger.warning("iteration %d: update skipped (gradient norm %s)", it, norm)
        self._report(batch, plan, variant, result, stats, seconds, norm, bound)
        self._judge(it - 1, finite(stats.loss) and finite(None if norm is None else float(norm)))
        try:
            self.nonfinite.observe(it, loss=stats.loss, grad_norm=norm)
        except NonFiniteError as error:
            raise NonFiniteError(str(error) + self._stop_advice()) from None
        if self.writer is not None:
            with self.ctx.watch.phase("checkpoint publish"):
                self.writer.poll()  # publish background saves that have finished

    def _judge(self, iteration: int, ok: bool) -> None:
        """Iteration `iteration + 1` computed with the weights saved after `iteration`: their
        checkpoint (saved by this run, or the one it loaded) is verified when `ok`."""
        if self.loaded is not None and iteration == self.loaded[1]:
            self.loaded_finite = ok
        if self.writer is not None:
            with self.ctx.watch.phase("checkpoint publish"):
                self.writer.judge(iteration, ok)

    def _stop_advice(self) -> str:
        """The end of the non-finite stop line (`resume_advice`), once saves in flight are in."""
        verified, rejected = None, []
        if self.loaded is not None and self.loaded_finite:
            verified = self.loaded
        if self.writer is not None:  # every rank stops here: finish the earlier saves
            with self.ctx.watch.phase("checkpoint publish"):
                self.writer.wait()
            rejected = [*self.writer.rejected, *self.writer.staged.values()]
            if self.writer.published:
                path = self.writer.published[-1]
                verified = (path, int(path.name.split("_", 1)[1]))
        return resume_advice(verified, rejected, saving=self.writer is not None)

    def _verify_final_save(self) -> None:
        """The save after the last iteration has no next iteration: a forward-only pass over the
        next training batch verifies it (its data position is before that batch)."""
        it = self.iteration
        if self.writer is None or it not in {*self.writer.writing, *self.writer.staged}:
            return
        *_, stats = self._forward_backward(self.stream, evaluation=True)
        if self.ctx.is_logging_rank:
            logger.info(
                "checkpoint of iteration %d: the next batch's loss with its weights is %.4f "
                "(forward only, to verify it)",
                it,
                stats.loss,
            )
        self._judge(it, finite(stats.loss))

    def _calibrate(self, stats) -> None:
        """Record the cost model's error on this iteration, then feed the calibration window
        (identical numbers on every rank, so every rank updates identically). The first
        iteration this process runs is left out: it pays for allocation, lazy initialisation
        and autotuning, and would skew the whole first window."""
        it, c = self.iteration + 1, self.calibration
        error = c.error(stats.measured, stats.predicted)
        if error is not None:
            self.result.cost_error[it] = error
            self.result.cost_ratio[it] = c.ratio(stats.measured, stats.predicted)
        if self.plans is not None:
            self.result.plan_calibration[it] = self.plans.plan_calibration
        if self.iteration == self.result.first_iteration:
            return
        if c.observe(stats.measured, stats.predicted) and self.plans is not None:
            self.plans.calibrate(version=c.version, scales=c.scales)
            logger.debug(
                "iteration %d: cost-model calibration version %d %s", it, c.version, c.scales
            )

    def _planned(self, plan, result: StepResult):
        """The backend's prediction of `plan` on the channels `result` ran on (real compute:
        the calibrated cost model, None while uncalibrated on CPU; emulated: its scaled one)."""
        return self.backend.predicted(plan, channel=result.channel, calibration=self.calibration)

    def _report(self, batch, plan, variant, result: StepResult, stats, seconds, norm, bound):
        it, spec = self.iteration, self.spec
        logging_now = it % spec.reporting.log_interval == 0 or it == spec.training.iterations
        tracing = spec.reporting.trace_dir is not None and it % spec.reporting.trace_interval == 0
        spans = self._gather_spans(result) if tracing else None
        if not self.ctx.is_logging_rank:
            return
        sim = self._planned(plan, result) if logging_now or tracing else None
        if sim is not None:
            self.result.planned[it] = sim.iteration_time
        self.log.restarts = self.plans.restarts if self.plans is not None else 0
        self.log.add(
            IterationRecord(
                iteration=it,
                loss=stats.loss,
                lr=float(self.optimizer.param_groups[0]["lr"]),
                grad_norm=None if norm is None else float(norm),
                seconds=seconds,
                schedule_seconds=stats.max_duration,
                samples=batch.num_samples,
                consumed=self.consumed,
                tokens=batch_tokens(self.spec.model, batch)[self.spec.model.loss_module.name],
                flops=model_flops(self.spec.model, self.spec.cost_model, batch),
                bound_efficiency=bound,
                variant=variant,
                planned_seconds=None if sim is None else sim.iteration_time,
                cost_error=self.result.cost_error.get(it),
                calibration_version=self.calibration.version,
                skipped=self.stream.skipped + self.blanked,
                truncated=self.stream.truncated,
            )
        )
        if logging_now:
            logger.info(self.log.line() + self._blend_shares())
        if spec.reporting.metrics_json:
            self._write_metrics(plan, variant, stats, seconds, sim, result)
        if spans is not None:
            planned = sim or simulate(plan, self.spec.cost_model, channel=result.channel)
            write_trace(spec.reporting.trace_dir, it, planned, spans)

    def _blend_shares(self) -> str:
        """--dip-log-blend: " | blend: NAME 49.8%, ..." of the samples consumed so far (sources
        without a blend, e.g. LLaVA JSON, give nothing)."""
        shares = getattr(self.stream.source, "realised_shares", None)
        if not self.spec.reporting.log_blend or shares is None:
            return ""
        names = [p.name for p in self.stream.source.parts]
        got = shares(self.consumed)
        return " | blend: " + ", ".join(
            f"{n} {100 * v:.1f}%" for n, v in zip(names, got, strict=True)
        )

    def _write_metrics(self, plan, variant: str, stats, seconds: float, sim, result) -> None:
        """One line of --dip-metrics-json (see `log.append_record`); the backend adds its fields."""
        record = {
            "iteration": self.iteration, "schedule": self.spec.schedule, "variant": variant,
            "loss": stats.loss, "seconds": seconds, "schedule_seconds": stats.max_duration,
            "busy_seconds": stats.max_busy, "plan_wait_seconds": self.plan_wait,
            "end_time": time.time(),  # when it ended (Unix seconds): start-up as a user waits it
        }  # fmt: skip
        record.update(self.backend.metrics(plan, sim=sim, channel=result.channel))
        append_record(self.spec.reporting.metrics_json, record)

    def _gather_spans(self, result: StepResult) -> list | None:
        """Measured spans of replica 0's pipeline ranks, by pipeline rank, on rank 0."""
        ctx = self.ctx
        mine = (ctx.dp_rank, ctx.tp_rank, ctx.pp_rank, result.spans)
        out = [None] * ctx.world_size if ctx.rank == 0 else None
        with ctx.watch.phase("trace gather"):
            dist.gather_object(mine, out, dst=0)
        if ctx.rank != 0:
            return None
        rows = sorted((pp, spans) for dp, tp, pp, spans in out if dp == 0 and tp == 0)
        return [spans for _, spans in rows]

    # -- evaluation -----------------------------------------------------------------------

    def evaluate(self) -> float:
        """Loss over --eval-iters batches of the evaluation stream, forward-only plans."""
        if self.eval_stream is None:
            self.eval_stream = self._stream(evaluation=True)
        loss = tokens = 0.0
        n = self.spec.reporting.eval_iters
        for _ in range(n):
            *_, stats = self._forward_backward(self.eval_stream, evaluation=True)
            loss += stats.loss * stats.loss_tokens
            tokens += stats.loss_tokens
        value = loss / max(tokens, 1.0)
        self.result.eval_losses[self.iteration] = value
        if self.ctx.is_logging_rank:
            logger.info(self.log.eval_line(self.iteration, value, n))
        return value

    # -- the loop -------------------------------------------------------------------------

    def run(self) -> TrainResult:
        spec = self.spec
        if spec.checkpointing.load is not None or self.spec.pretrained:
            self.load()
        if self.plans is not None:
            self.plans.ahead(self.stream)  # the first batches, before the warm-up
        with self.ctx.watch.phase("pipeline warm-up"):
            warm_up_pipeline(self.ctx, pipeline_peers(self.spec.placement, self.ctx.pp_rank))
        self.result.first_iteration = self.iteration
        saved_at = None
        while self.iteration < spec.training.iterations:
            self.train_step()
            it = self.iteration
            if (
                spec.checkpointing.save
                and spec.checkpointing.save_interval
                and it % spec.checkpointing.save_interval == 0
            ):
                self.save()
                saved_at = it
            if spec.reporting.eval_interval and it % spec.reporting.eval_interval == 0:
                self.evaluate()
        if spec.checkpointing.save and saved_at != self.iteration:
            self.save()
        if self.writer is not None:
            self._verify_final_save()
            with self.ctx.watch.phase("checkpoint publish"):
                self.writer.wait()
            self.result.checkpoints = [str(p) for p in self.writer.published]
        self.result.last_iteration = self.iteration
        self.result.calibration = self.calibration.state_dict()
        return self.result

    def close(self, *, completed: bool = True) -> None:
        """Stop the planner and the log; a run that failed abandons unfinished saves (they
        stay unpublished) instead of waiting for ranks that may never finalize them."""
        if self.writer is not None and not completed:
            self.writer.abort()
        if self.plans is not None:
            self.plans.close()
        self.log.close()


def _nothing_to_train(spec: RunSpec) -> bool:
    """--load of a checkpoint at --train-iters: say so in one line (a later one is refused by
    validation)."""
    resume, iters = spec.resume, spec.training.iterations
    if resume is None or resume.iteration < iters:
        return False
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    if rank == 0:
        logger.info(
            "--train-iters %d: the checkpoint %s is at iteration %d already: nothing to train",
            iters,
            resume.path,
            resume.iteration,
        )
    return True


def pretrain(spec: RunSpec) -> TrainResult:
    """Initialise the process groups, train, and tear down (every rank calls this)."""
    if _nothing_to_train(spec):
        it = spec.resume.iteration
        return TrainResult(first_iteration=it, last_iteration=it)
    ctx = initialize(spec)
    trainer, completed, lock = None, False, None
    try:
        if spec.checkpointing.save:  # one job at a time on --save, before any work
            lock = hold_save_lock(spec.checkpointing.save, rank=ctx.rank)
        with ctx.watch.phase("start-up"):
            trainer = Trainer(spec, ctx)
        result = trainer.run()
        # Without torchrun rank 0 hosts the job's store: no rank may still be working when it
        # leaves, or its heartbeat would take the store's loss for the launcher's death.
        with ctx.watch.phase("finish"):
            dist.barrier()
        completed = True
        return result
    except (StallError, SaveLockedError):
        raise
    except Exception as error:  # the other ranks name this rank's error, not its absence
        ctx.watch.report_failure(error)
        raise
    finally:
        if trainer is not None:
            trainer.close(completed=completed)
        if lock is not None:
            lock.release()
        ctx.destroy()
