"""Training: flags (`arguments`), presets, validation before any process group (`validate`),
process groups (`setup`), the compute backend chosen once per run (`backend`: real or emulated),
model/optimizer building, the step (`step`: DIP on the runtime, or Megatron's own schedules), the
loop (`loop`), logging, checkpoints.

Entry points: `pretrain_vlm_dip.py`, `pretrain_diffusion_dip.py` (`entry.main`). See
docs/training.md. Importing this package is cheap (no torch).
"""
