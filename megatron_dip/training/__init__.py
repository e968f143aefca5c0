"""Training: flags (`arguments`), presets, validation before any process group (`validate`),
process groups (`setup`), model/optimizer building, the loop (`loop`), logging, checkpoints.

Entry points: `pretrain_vlm_dip.py`, `pretrain_diffusion_dip.py` (`entry.main`). See
docs/training.md. Importing this package is cheap (no torch).
"""
