"""megatron-dip: DIP, a dynamic modality-aware interleaved pipeline schedule for Megatron-Core."""

from pathlib import Path

from setuptools import find_packages, setup

setup(
    name="megatron-dip",
    version="0.1.0",
    description="Dynamic modality-aware interleaved pipeline schedules for Megatron-Core",
    long_description=Path(__file__).with_name("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_dip", "megatron_dip.*"]),
    # Ranges only: GPU clusters bring their own torch. The exact CPU pin lives in the README's
    # set-up command. megatron-core 0.16.1 (Python 3.11) and 0.19.x are tested.
    install_requires=[
        "torch>=2.6",
        "megatron-core>=0.16.1,<0.20",
        "numpy>=1.24",
        "scipy>=1.11",
        # The planner's list scheduler is compiled (planner/schedule_kernel.py).
        "numba>=0.61",
        "matplotlib>=3.7",
        "pillow>=10",
    ],
    extras_require={
        "test": ["pytest>=8", "pytest-timeout>=2.2", "hypothesis>=6.100", "ruff>=0.6"],
        # Optional GPU accelerations; nothing in megatron-dip requires them.
        "gpu": ["transformer-engine[pytorch]"],
    },
)
