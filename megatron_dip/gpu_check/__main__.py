"""`python -m megatron_dip.gpu_check`: the command of the package docstring."""

from .command import main

raise SystemExit(main())
