"""Training, in four sub-packages that depend on each other one way:

* `config`: the flags (`arguments`, `megatron_args`), `--model` presets, the checks before any
  process group (`validate`), pricing, the start-up sizing (`layout`) and the one resolved,
  frozen run (`run.RunSpec`) that everything after resolve reads;
* `checkpoint`: directories and the checks before start (`dirs`, `resume_checks`, `save_lock`),
  files and checksums (`storage`, `checksums`, `publish`), the training state (`state`), the
  optimizer state (`optim_state`), fine-tuning starts (`finetune`) and Hugging Face conversion
  (`huggingface`);
* `assembly`: process groups (`setup`), the compute backend (`backend`: real or emulated), the
  model chunks (`build`) and the optimizer (`optim`);
* `iteration`: the loop (`loop`), one step (`step`: DIP on the runtime, or Megatron's own
  schedules), where plans come from (`planning`), metrics, logging and the non-finite stop.

Entry points: `pretrain_vlm_dip.py`, `pretrain_diffusion_dip.py` (`entry.main`). See
docs/training.md and docs/design.md. Importing this package is cheap (no torch).
"""
