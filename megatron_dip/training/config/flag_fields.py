"""The flag-field helper shared by the flag sections (`arguments.py`, `megatron_args.py`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import field
from typing import Any

PRESET = " (default: from the --model preset)"


def arg(
    flag: str,
    default: Any,
    help: str,
    *,
    choices: Sequence[str] | None = None,
    megatron: bool = True,
) -> Any:
    """A dataclass field that is also a command-line flag."""
    meta = {"flag": flag, "help": help, "choices": choices, "megatron": megatron}
    return field(default=default, metadata=meta)
