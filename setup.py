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
        # The planner's list scheduler is compiled (planner/schedule_kernel.py); without numba
        # the same code runs interpreted (identical plans, far slower at paper scale).
        "numba>=0.61",
        "matplotlib>=3.7",
        "pillow>=10",
        # megatron.core.dist_checkpointing's torch_dist writer imports it (not declared there).
        "psutil>=5.9",
    ],
    extras_require={
        # Hugging Face tokenizers and chat templates (--tokenizer-type HuggingFaceTokenizer);
        # imported only by such runs (AutoTokenizer, apply_chat_template, offsets).
        "hf": ["transformers>=4.45", "tokenizers>=0.20"],
        # Megatron-Energon datasets (--dip-data energon:PATH); it asks for a bare `torch`, so
        # install torch first (the README's set-up command does).
        "energon": ["megatron-energon>=7.4,<8"],
        "test": [
            # <9.2: pytest-xdist 3.8's `--dist loadgroup` (the README's test command) tags a
            # test's group onto `item._nodeid`, which pytest 9.2 no longer reads: the groups are
            # then silently lost and two 4-process worlds share the 2 cores (19 min, not 10).
            "pytest>=8,<9.2",
            "pytest-timeout>=2.2",
            "pytest-xdist>=3.5",  # the README's test command runs two workers
            "hypothesis>=6.100",
            "ruff>=0.6",
            # the tested versions: transformers 5.24 (its PIL Qwen2-VL image processor is the
            # reference of data/image.py), tokenizers 0.23, megatron-energon 7.4.1
            "transformers>=5.24,<6",
            "tokenizers>=0.22",
            "megatron-energon>=7.4,<8",
        ],
        # Optional GPU accelerations; nothing in megatron-dip requires them.
        "gpu": ["transformer-engine[pytorch]"],
    },
)
