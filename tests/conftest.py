"""Shared pytest configuration: one torch thread per test process, and the --fuzz switch.

Tests run on two shared cores with tiny tensors: intra-op threads gain nothing and spinning
OpenMP threads made single-process tests up to 30x slower. torch is not imported here (data-only
runs stay fast); whoever imports it, every test starts with `torch.set_num_threads(1)`.
"""

import sys

from hypothesis import HealthCheck, settings

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
