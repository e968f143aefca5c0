"""Training: flags (`arguments`), presets, validation before any process group (`validate`),
process groups (`setup`), the compute backend chosen once per run (`backend`: real or emulated),
model/optimizer building, the step (`step`: DIP on the runtime, or Megatron's own schedules), the
loop (`loop`), logging, checkpoints (`checkpoint`: training state and weights-only; on
`checkpoint_io` over Megatron-Core's dist_checkpointing, `checkpoint_dirs` for the directories
and the checks before start, `optim_state` for the optimizer state), `nonfinite` (stop on a
NaN streak).

Entry points: `pretrain_vlm_dip.py`, `pretrain_diffusion_dip.py` (`entry.main`). See
docs/training.md. Importing this package is cheap (no torch).
"""
