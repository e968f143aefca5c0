"""The run's parallel shape (`megatron_dip.parallel.shape`) and its group rank lists (`grid`):
derivations and errors, and the rank lists against Megatron-Core's own `RankGenerator` (the
convention of `initialize_model_parallel`, order "tp-cp-ep-dp-pp"), computed in one process
without creating any group. The groups themselves are exercised by the multi-process tests."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from megatron_dip.parallel import ParallelShape, ShapeError, grid

PACKAGE = Path(__file__).resolve().parent.parent / "megatron_dip"
SHAPES = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 1), (2, 1, 3), (2, 2, 2), (4, 3, 2)]


def test_the_shape_derives_the_world_and_sequence_parallelism_once() -> None:
    shape = ParallelShape.for_world(24, tp=2, pp=3, sp=True, seq_length=64)
    assert (shape.dp, shape.world_size, shape.model_parallel) == (4, 24, 6)
    assert shape.sequence_parallel and shape.sequence_split == 2
    assert shape.sequence_shard(10) == 5
    # Asked for, but without tensor parallelism there is nothing to shard over.
    single = shape.replace(tp=1)
    assert single.sp and not single.sequence_parallel
    assert single.sequence_shard(7) == 7
    assert not ParallelShape(tp=4).sequence_parallel  # not asked for


@pytest.mark.parametrize(
    ("build", "flag"),
    [
        (lambda: ParallelShape.for_world(6, tp=4), "--tensor-model-parallel-size/"),
        (lambda: ParallelShape.for_world(8, tp=0), "--tensor-model-parallel-size:"),
        (lambda: ParallelShape.for_world(8, pp=0), "--pipeline-model-parallel-size:"),
        (lambda: ParallelShape(tp=2, cp=2), "--context-parallel-size:"),
        (lambda: ParallelShape(vp=0), "--num-virtual-stages-per-pipeline-rank:"),
        (lambda: ParallelShape(seq_length=0), "--seq-length:"),
        (lambda: ParallelShape(sp=True).check_sequence_parallel(), "--sequence-parallel:"),
        (
            lambda: ParallelShape(tp=4, sp=True, seq_length=30).check_sequence_parallel(),
            "--sequence-parallel:",
        ),
    ],
)
def test_bad_sizes_name_their_flag(build, flag: str) -> None:
    with pytest.raises(ShapeError) as e:
        build()
    assert str(e.value).startswith(flag), str(e.value)


def test_a_sequence_shard_that_does_not_divide_is_refused() -> None:
    with pytest.raises(ValueError, match="do not divide by tensor parallel size 4"):
        ParallelShape(tp=4, sp=True).sequence_shard(10)


@pytest.mark.parametrize(("tp", "dp", "pp"), SHAPES)
def test_coordinates_follow_megatron_lms_tp_dp_pp_order(tp: int, dp: int, pp: int) -> None:
    shape = ParallelShape(tp=tp, dp=dp, pp=pp)
    for rank in range(shape.world_size):
        c = grid.coordinates(rank, shape)
        assert rank == c.tp + tp * (c.dp + dp * c.pp)
        assert grid.global_rank(shape, tp=c.tp, dp=c.dp, pp=c.pp) == rank
    with pytest.raises(ValueError):
        grid.coordinates(shape.world_size, shape)


@pytest.mark.parametrize(("tp", "dp", "pp"), SHAPES)
def test_group_rank_lists_are_megatrons(tp: int, dp: int, pp: int) -> None:
    from megatron.core.parallel_state import RankGenerator

    megatron = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    shape = ParallelShape(tp=tp, dp=dp, pp=pp)
    for dims in ("tp", "dp", "pp", "tp-pp", "tp-dp", "dp-pp", "tp-dp-pp", "cp"):
        assert grid.group_ranks(shape, dims) == megatron.get_ranks(dims), dims


@pytest.mark.parametrize(("tp", "dp", "pp"), SHAPES)
def test_every_rank_is_in_exactly_one_group_of_each_kind(tp: int, dp: int, pp: int) -> None:
    shape = ParallelShape(tp=tp, dp=dp, pp=pp)
    for dims, size in (("tp", tp), ("dp", dp), ("pp", pp), ("tp-pp", tp * pp)):
        groups = grid.group_ranks(shape, dims)
        assert all(len(g) == size for g in groups)
        assert sorted(r for g in groups for r in g) == list(range(shape.world_size))


def test_tied_embedding_and_channel_rank_lists() -> None:
    shape = ParallelShape(tp=2, dp=2, pp=3)
    # Megatron's embedding group: the first and last stage of every pipeline.
    assert grid.stage_ranks(shape, (0, 2)) == [[0, 8], [1, 9], [2, 10], [3, 11]]
    pairs = grid.channel_pairs([[0, 4, 8]])
    assert [(a, b, r) for _, a, b, r in pairs] == [
        (0, 1, [0, 4]), (0, 2, [0, 8]), (1, 0, [0, 4]),
        (1, 2, [4, 8]), (2, 0, [0, 8]), (2, 1, [4, 8]),
    ]  # fmt: skip
    assert grid.single_ranks(ParallelShape(pp=2)) == [[0], [1]]


def test_unknown_dimensions_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown grid dimensions"):
        grid.group_ranks(ParallelShape(), "ep")


def _calls_new_group(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if name in ("new_group", "new_subgroups_by_enumeration"):
                return True
    return False


def test_one_module_creates_process_groups() -> None:
    creators = sorted(
        str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if _calls_new_group(p)
    )
    assert creators == ["parallel/groups.py"]


def test_the_shape_and_grid_need_no_torch() -> None:
    for name in ("shape.py", "grid.py", "__init__.py"):
        tree = ast.parse((PACKAGE / "parallel" / name).read_text())
        imported = {
            (a.name if isinstance(n, ast.Import) else n.module or "").split(".")[0]
            for n in ast.walk(tree)
            if isinstance(n, ast.Import | ast.ImportFrom)
            for a in (n.names if isinstance(n, ast.Import) else [n])
        }
        assert "torch" not in imported and "megatron" not in imported, name


def test_run_groups_in_a_one_rank_world(single_rank_world) -> None:
    from megatron_dip.parallel.groups import create_run_groups, importer_groups

    groups = create_run_groups(ParallelShape(), tied_stages=())
    try:
        assert groups.coordinates == (0, 0, 0, 0) and groups.channels is None
        assert groups.embedding is None and groups.cp is groups.single
        assert all(g.size() == 1 for g in (groups.tp, groups.dp, groups.pp, groups.mp))
        collection = groups.collection()
        assert collection is groups.collection()  # built once per run
        assert (collection.tp, collection.dp, collection.dp_cp) == (groups.tp, groups.dp, groups.dp)
        assert (collection.pp, collection.mp, collection.tp_ep_pp) == (groups.pp,) + (
            groups.mp,
        ) * 2
        assert collection.expt_dp is groups.single and collection.cp is groups.cp
        with pytest.raises(RuntimeError, match="validated for 2 processes, found 1"):
            create_run_groups(ParallelShape(dp=2))
        tp, single = importer_groups(tp=1, pp=1)
        assert tp.size() == single.size() == 1
    finally:
        groups.destroy()
    assert groups.created == []
