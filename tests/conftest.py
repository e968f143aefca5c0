"""Shared pytest configuration: one torch thread per test process, and the --fuzz switch.

`megatron_dip` is imported first, as in every process of ours, so its compatibility layer
(`megatron_compat`: the triton stand-in, Megatron's fusions eager without CUDA) is in place
before any test or helper imports `megatron.core` (the package import is light: no torch).

Tests run on two shared cores with tiny tensors: intra-op threads gain nothing and spinning
OpenMP threads made single-process tests up to 30x slower. torch is not imported here (data-only
runs stay fast); whoever imports it, every test starts with `torch.set_num_threads(1)`.
"""

import sys

import pytest
from hypothesis import HealthCheck, settings

import megatron_dip  # noqa: F401  (before megatron.core, see above)

settings.register_profile(
    "ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "fuzz", max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("ci")


def pytest_addoption(parser):
    parser.addoption("--fuzz", action="store_true", help="run property tests with many more cases")


def pytest_configure(config):
    if config.getoption("--fuzz"):
        settings.load_profile("fuzz")


def pytest_runtest_setup(item):
    """One intra-op thread for the whole session, once torch is imported (by any module)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() != 1:
        torch.set_num_threads(1)


@pytest.fixture(scope="module")
def single_rank_world(tmp_path_factory):
    """A one-rank gloo world for in-process tests of distributed code. Torn down after the module,
    so tests that check that nothing initialised a process group see none."""
    import torch.distributed as dist

    created = not dist.is_initialized()
    if created:
        store = dist.FileStore(str(tmp_path_factory.mktemp("dist") / "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield dist.group.WORLD
    if created:
        dist.destroy_process_group()


# Under the README's `-n 2 --dist loadgroup --no-loadscope-reorder` (pytest-xdist): the tests
# that start gloo worlds (the `distributed` marker: 4 processes each, about 1.6 of the 2 cores)
# run first, one module after the other on one worker: two such worlds at once on 2 cores slowed
# each other 1.5-2.7x. The other worker takes the one-process modules meanwhile, each module on
# one worker (its module-scoped fixtures set up once).
WORLDS = "gloo worlds"


def pytest_itemcollected(item):
    """The `distributed` tests in one xdist group, every other module in its own (marked as each
    item is collected, before any `pytest_collection_modifyitems`, where xdist reads them)."""
    world = item.get_closest_marker("distributed") is not None
    item.add_marker(pytest.mark.xdist_group(WORLDS if world else item.path.name))


def pytest_collection_modifyitems(config, items):
    """The `distributed` tests first (the order of the groups under --no-loadscope-reorder)."""
    items.sort(key=lambda item: item.get_closest_marker("distributed") is None)  # stable
