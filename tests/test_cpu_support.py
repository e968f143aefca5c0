"""CPU fixes (cpu_support) and the megatron-core compatibility layer (megatron_compat)."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron_dip import megatron_compat
from megatron_dip.cpu_support import apply_cpu_fixes, cpu_fixes_applied, seed_model_parallel_rng

needs_cpu_only = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU fixes apply without CUDA"
)


@pytest.fixture(scope="module")
def world(single_rank_world) -> dist.ProcessGroup:
    return single_rank_world


@needs_cpu_only
def test_apply_cpu_fixes_twice_is_harmless():
    assert apply_cpu_fixes() is True
    depth = torch._C._len_torch_function_stack()
    assert apply_cpu_fixes() is True
    assert torch._C._len_torch_function_stack() == depth
    assert cpu_fixes_applied()
    x = torch.ones(2)
    assert (x * 2).sum().item() == 4.0  # one redirecting mode, no recursion


@needs_cpu_only
def test_cuda_calls_run_on_cpu():
    apply_cpu_fixes()
    assert torch.zeros([], dtype=torch.int, device="cuda").device.type == "cpu"
    assert torch.empty(3, device=torch.cuda.current_device()).device.type == "cpu"
    assert torch.tensor([1, 2], device=0).device.type == "cpu"
    x = torch.ones(3)
    assert x.cuda() is x
    assert x.to("cuda:0").device.type == "cpu"
    torch.cuda.synchronize()
    stream = torch.cuda.Stream(device=torch.cuda.current_device())
    stream.wait_stream(torch.cuda.default_stream())
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.stream(stream):
        pass


@needs_cpu_only
def test_the_cuda_to_cpu_mode_is_suspended_only_where_asked_and_only_if_innermost():
    """DIP's executor runs without the mode (every torch call would dispatch through it); it
    is back afterwards, and a mode entered above ours is never disturbed."""
    from torch.overrides import TorchFunctionMode, _get_current_function_mode

    from megatron_dip.cpu_support import cuda_to_cpu_suspended

    apply_cpu_fixes()
    ours = _get_current_function_mode()
    with cuda_to_cpu_suspended():
        assert _get_current_function_mode() is None
        assert torch.ones(2).device.type == "cpu"
    assert _get_current_function_mode() is ours
    assert torch.zeros(1, device="cuda").device.type == "cpu"
    with TorchFunctionMode() as other, cuda_to_cpu_suspended():
        assert _get_current_function_mode() is other
    assert _get_current_function_mode() is ours


@needs_cpu_only
def test_megatron_scratch_buffer_allocates_on_cpu():
    from megatron.core.utils import GlobalMemoryBuffer

    apply_cpu_fixes()
    buffer = GlobalMemoryBuffer().get_tensor((2, 3), torch.float32, "test")
    assert buffer.device.type == "cpu" and tuple(buffer.shape) == (2, 3)


def _tiny_megatron_module():
    from megatron.core.enums import ModelType
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import MegatronModule

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)

    class Tiny(MegatronModule):
        def __init__(self) -> None:
            super().__init__(config=config)
            self.model_type = ModelType.encoder_or_decoder
            self.linear = torch.nn.Linear(4, 1)

        def set_input_tensor(self, tensor) -> None:
            del tensor

        def forward(self, x):
            return self.linear(x)

    return Tiny()


def test_stock_schedule_runs_after_fixes(world):
    """forward_backward_no_pipelining allocates `device="cuda"` tensors: works after the fixes."""
    apply_cpu_fixes()
    seed_model_parallel_rng(3)
    model = _tiny_megatron_module()
    data = [torch.randn(3, 4) for _ in range(2)]

    def forward_step(iterator, module):
        out = module(next(iterator))
        return out, lambda o: (o.pow(2).sum(), {"loss": o.pow(2).sum().detach()})

    pgs = megatron_compat.process_group_collection(
        tp=world, cp=world, pp=world, dp_cp=world, embd=None, pos_embd=None
    )
    schedule = megatron_compat.get_forward_backward_func(pp_size=1, vp_size=None)
    losses = schedule(
        forward_step_func=forward_step,
        data_iterator=iter(data),
        model=[model],
        num_microbatches=2,
        seq_length=3,
        micro_batch_size=1,
        forward_only=False,
        pg_collection=pgs,
    )
    assert len(losses) == 2
    # Megatron divides each microbatch's loss by the number of microbatches.
    expected = sum(model(x).pow(2).sum() for x in data) / len(data)
    grad = torch.autograd.grad(expected, model.linear.weight)[0]
    torch.testing.assert_close(model.linear.weight.grad, grad)


def test_seed_model_parallel_rng_is_repeatable():
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    seed_model_parallel_rng(5)
    a = torch.rand(4)
    seed_model_parallel_rng(5)
    assert torch.equal(a, torch.rand(4))
    with get_cuda_rng_tracker().fork():  # what Megatron's attention enters
        pass


def test_schedule_selection_and_arguments():
    from megatron.core.pipeline_parallel import schedules

    select = megatron_compat.get_forward_backward_func
    assert select(pp_size=1, vp_size=None) is schedules.forward_backward_no_pipelining
    assert select(pp_size=2, vp_size=2) is schedules.forward_backward_pipelining_with_interleaving
    if megatron_compat.megatron_core_version() < (0, 19):
        with pytest.raises(TypeError, match="schedule_pg_collection"):
            select(pp_size=2, vp_size=None, schedule_pg_collection=object())


def test_backward_step_with_and_without_model_type():
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
    x = torch.ones(3, requires_grad=True)
    grads = megatron_compat.backward_step([x], [(2 * x).sum()], [None], config=config)
    torch.testing.assert_close(grads[0], torch.full((3,), 2.0))


def test_version_and_config_helpers():
    version = megatron_compat.megatron_core_version()
    assert len(version) == 3 and all(isinstance(v, int) for v in version)
    kwargs = megatron_compat.variable_seq_lengths_config()
    assert kwargs["variable_seq_lengths"] is True
    assert ("moe_token_dispatcher_type" in kwargs) == (version >= (0, 19))


def test_layer_backend_without_transformer_engine():
    from megatron.core.tensor_parallel import ColumnParallelLinear

    if megatron_compat.transformer_engine_available():
        pytest.skip("Transformer Engine installed")
    assert megatron_compat.resolve_use_te(None) is False
    with pytest.raises(RuntimeError, match="transformer_engine"):
        megatron_compat.resolve_use_te(True)
    backend = megatron_compat.layer_backend(False)
    assert backend.column_linear is ColumnParallelLinear
    spec = backend.gpt_layer_spec(normalization="RMSNorm")
    assert spec.submodules.self_attention is not None


def test_package_import_installs_compat_first_and_stays_light():
    """`import megatron_dip` runs megatron_compat (so the triton stand-in precedes any
    `import megatron.core`), without importing torch or megatron."""
    code = (
        "import sys, megatron_dip\n"
        "assert 'megatron_dip.megatron_compat' in sys.modules\n"
        "heavy = sorted(m for m in ('torch', 'megatron', 'numpy') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@needs_cpu_only
def test_megatron_fusions_run_eagerly_without_cuda(monkeypatch):
    """Without CUDA, Megatron's `jit_fuser` is its own no-op decorator from the moment
    `megatron.core.jit` loads (megatron_dip is imported first, as in every process of ours), so
    its fused functions are plain Python functions and torch's compiler stack is never
    imported; with CUDA the finder steps aside and Megatron loads as it is."""
    import megatron.core
    from megatron.core import jit
    from megatron.core.fusions import fused_bias_gelu

    assert jit.jit_fuser is jit.noop_decorator
    assert type(fused_bias_gelu.bias_gelu) is types.FunctionType
    finder = megatron_compat.EagerFusionsWithoutCuda()
    assert finder.find_spec("megatron.core.utils", None) is None
    spec = finder.find_spec("megatron.core.jit", list(megatron.core.__path__))
    assert isinstance(spec.loader, megatron_compat._DisableFuserAfterLoad)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert finder.find_spec("megatron.core.jit", list(megatron.core.__path__)) is None


def test_version_is_read_from_the_megatron_that_imports():
    import importlib.metadata

    from megatron.core import package_info

    version = megatron_compat.megatron_core_version()
    assert version == tuple(package_info.VERSION[:3])
    assert version == megatron_compat._version_tuple(importlib.metadata.version("megatron-core"))
    assert megatron_compat._version_tuple("0.16.0rc0.dev100085") == (0, 16, 0)
    assert megatron_compat._version_tuple("0.19.2") == (0, 19, 2)


@pytest.mark.parametrize("version", [(0, 16, 1), (0, 17, 0), (0, 19, 2), (0, 19, 99), None])
def test_supported_megatron_core_versions_pass(version):
    megatron_compat.check_megatron_core_version(version)


@pytest.mark.parametrize("version", [(0, 15, 3), (0, 16, 0), (0, 20, 0), (1, 0, 0)])
def test_unsupported_megatron_core_versions_are_refused(version):
    found = ".".join(map(str, version))
    with pytest.raises(ImportError, match=rf">= 0\.16\.1, < 0\.20; found {found}"):
        megatron_compat.check_megatron_core_version(version)


def test_import_refuses_an_unsupported_megatron_core(tmp_path):
    """`import megatron_dip` with a megatron-core 0.20 first on the path: one clear error
    naming the version and where it is, before anything calls into Megatron."""
    core = tmp_path / "megatron" / "core"
    core.mkdir(parents=True)
    (core / "__init__.py").write_text("")
    (core / "package_info.py").write_text('MAJOR = 0\nMINOR = 20\nPATCH = 0\nPRE_RELEASE = ""\n')
    repo = Path(megatron_compat.__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(repo)])}
    result = subprocess.run(
        [sys.executable, "-c", "import megatron_dip"],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode != 0
    assert "ImportError: megatron-dip supports megatron-core >= 0.16.1, < 0.20; found 0.20.0" in (
        result.stderr
    )
    assert str(tmp_path / "megatron") in result.stderr


def test_triton_stand_in_only_when_triton_is_missing(monkeypatch, tmp_path):
    name = "megatron.core.transformer.moe.ops.paged_stash"
    if name in sys.modules:  # a real one (triton installed) must stay untouched
        assert not megatron_compat.install_triton_stand_in() or getattr(
            sys.modules[name], "__megatron_dip_stand_in__", False
        )
        return
    fake = tmp_path / "megatron"
    (fake / "core/transformer/moe/ops").mkdir(parents=True)
    (fake / "core/transformer/moe/ops/paged_stash.py").write_text("import triton\n")
    monkeypatch.setattr(megatron_compat, "_megatron_dir", lambda: fake)
    real_find_spec = megatron_compat.importlib.util.find_spec
    monkeypatch.setattr(
        megatron_compat.importlib.util,
        "find_spec",
        lambda n, *a: types.SimpleNamespace() if n == "triton" else real_find_spec(n, *a),
    )
    assert megatron_compat.install_triton_stand_in() is False  # triton "installed"
    assert name not in sys.modules
    monkeypatch.setattr(
        megatron_compat.importlib.util,
        "find_spec",
        lambda n, *a: None if n == "triton" else real_find_spec(n, *a),
    )
    monkeypatch.delitem(sys.modules, name, raising=False)
    assert megatron_compat.install_triton_stand_in() is True
    stand_in = sys.modules[name]
    assert stand_in.GLOBAL_BLOCK_SIZE == 1024
    with pytest.raises(RuntimeError, match="triton"):
        stand_in.paged_stash_copy_kernel[(1,)]
    monkeypatch.delitem(sys.modules, name)


@needs_cpu_only
def test_cpu_tensors_report_their_cuda_type():
    """Megatron's optimizers accept only "torch.cuda.*Tensor" parameters."""
    apply_cpu_fixes()
    x = torch.zeros(2)
    assert x.type() == "torch.cuda.FloatTensor"
    assert x.bfloat16().type() == "torch.cuda.BFloat16Tensor"
    y = x.type("torch.cuda.DoubleTensor")
    assert y.dtype == torch.float64 and y.device.type == "cpu"
    assert x.type(torch.float64).dtype == torch.float64


def _distributed_optimizer(world, module):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.process_groups_config import ProcessGroupCollection

    pgs = ProcessGroupCollection()
    for name in ("dp", "dp_cp", "tp", "pp", "mp", "ep", "expt_dp", "tp_ep_pp", "intra_dist_opt"):
        setattr(pgs, name, world)
    ddp = DistributedDataParallel(
        config=module.config,
        ddp_config=DistributedDataParallelConfig(
            overlap_grad_reduce=True, use_distributed_optimizer=True
        ),
        module=module,
        pg_collection=pgs,
    )
    config = OptimizerConfig(
        optimizer="adam", lr=1e-2, clip_grad=1.0, use_distributed_optimizer=True
    )
    return ddp, get_megatron_optimizer(
        config, [ddp], use_gloo_process_groups=False, pg_collection=pgs
    )


def _layouts(module) -> dict:
    """Each parameter of a one-process module, keyed by its local name in the checkpoint."""
    from megatron_dip.models.sharded import ParamLayout, Segment

    return {
        id(p): ParamLayout(
            name,
            tuple(p.shape),
            tuple(p.shape),
            0,
            (Segment(0, p.shape[0], 0),),
            alias=0,
            tp_replica=0,
        )
        for name, p in module.named_parameters()
    }


def _adam_state(optimizer) -> list[dict]:
    inner = optimizer.optimizer
    return [
        {k: v.clone() for k, v in inner.state[p].items()}
        for g in inner.param_groups
        for p in g["params"]
    ]


@needs_cpu_only
def test_megatron_distributed_optimizer_steps_on_cpu_and_its_state_round_trips(world, tmp_path):
    """With the fixes Megatron's DistributedOptimizer (and its gradient clipping) runs on CPU;
    its state goes out as dist_checkpointing shards in the parameters' coordinates and into a
    fresh optimizer unchanged."""
    from megatron.core import dist_checkpointing

    from megatron_dip.training.checkpoint import optim_state, storage
    from megatron_dip.training.checkpoint.storage import CheckpointWriter

    apply_cpu_fixes()
    seed_model_parallel_rng(3)
    model = _tiny_megatron_module()
    ddp, optimizer = _distributed_optimizer(world, model)
    before = model.linear.weight.detach().clone()
    for _ in range(2):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        with ddp.no_sync():  # the reduction is started below, as the executor does
            model(torch.randn(3, 4)).pow(2).sum().backward()
        ddp.start_grad_sync()
        ddp.finish_grad_sync()
        ok, norm, _ = optimizer.step()
        assert ok and norm > 0
    assert not torch.equal(model.linear.weight, before)
    sharded, common = optim_state.sharded_state(optimizer, _layouts(model), dp_rank=0)
    assert set(sharded) == {"linear.weight", "linear.bias"} and common == {"step": 2}
    path = CheckpointWriter(group=None, async_save=False).save({"optimizer": sharded}, tmp_path, 2)

    other = _tiny_megatron_module()
    other.load_state_dict(model.state_dict())
    _, fresh = _distributed_optimizer(world, other)
    keys = set(dist_checkpointing.load_tensors_metadata(str(path)))
    assert "optimizer.state.exp_avg.linear.weight" in keys
    request, masters, set_steps = optim_state.load_request(
        fresh, _layouts(other), dp_rank=0, saved_keys=keys
    )
    storage.load_sharded({"optimizer": request}, path)
    set_steps(common["step"])
    assert not masters
    for want, got in zip(_adam_state(optimizer), _adam_state(fresh), strict=True):
        assert set(want) == set(got) == {"exp_avg", "exp_avg_sq", "step"}
        assert want["exp_avg_sq"].min() > 0
        for k, v in want.items():
            torch.testing.assert_close(got[k], v, rtol=0, atol=0)


def _mixed_precision_optimizer(world, module, *, clip_grad: float):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.process_groups_config import ProcessGroupCollection

    pgs = ProcessGroupCollection()
    for name in ("dp", "dp_cp", "tp", "pp", "mp", "ep", "expt_dp", "tp_ep_pp", "intra_dist_opt"):
        setattr(pgs, name, world)
    module.config.bf16 = True
    ddp = DistributedDataParallel(
        config=module.config,
        ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True),
        module=module,
        pg_collection=pgs,
    )
    config = OptimizerConfig(
        optimizer="adam", lr=1e-2, clip_grad=clip_grad, bf16=True, params_dtype=torch.bfloat16
    )
    return ddp, get_megatron_optimizer(
        config, [ddp], use_gloo_process_groups=False, pg_collection=pgs
    )


@needs_cpu_only
def test_megatron_mixed_precision_optimizer_steps_bf16_weights_on_cpu(world):
    """--bf16 on the CPU: Megatron's Float16OptimizerWithFloat16Params keeps fp32 master weights
    of the bf16 parameters, clips their gradient and copies the update back (cpu_support's
    fixes are all it needs)."""
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    from megatron_dip.training.assembly.optim import optimizer_pairs

    apply_cpu_fixes()
    seed_model_parallel_rng(3)
    model = _tiny_megatron_module().to(torch.bfloat16)
    ddp, optimizer = _mixed_precision_optimizer(world, model, clip_grad=1e-3)
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    assert all(isinstance(o, Float16OptimizerWithFloat16Params) for o in parts)
    pairs = optimizer_pairs(optimizer)
    assert pairs and all(
        p.dtype == torch.bfloat16 and m.dtype == torch.float32 for p, m, _ in pairs
    )
    before = {id(m): m.detach().clone() for _, m, _ in pairs}
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    model(torch.randn(3, 4, dtype=torch.bfloat16)).float().pow(2).sum().mul(100).backward()
    ddp.finish_grad_sync()
    ok, norm, _ = optimizer.step()
    assert ok and norm > 1e-3  # the norm before clipping: clipped down to --clip-grad
    clipped = torch.cat([m.grad.flatten() for _, m, _ in pairs]).norm()
    assert float(clipped) == pytest.approx(1e-3, rel=1e-2)
    for p, m, _ in pairs:
        assert not torch.equal(m, before[id(m)])  # the fp32 master moved ...
        assert torch.equal(p, m.to(torch.bfloat16))  # ... and the bf16 weight is its copy
