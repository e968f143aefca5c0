"""Shared pytest configuration: the --fuzz switch for the property tests."""

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
