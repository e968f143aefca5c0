"""The benchmark of DIP against Megatron-Core's stock schedules (`tools/bench_schedules.py`).

`bench.py`: presets of emulated paper setups, the stock placements a Megatron user would pick,
the emulation scale, and the runs' summaries; `plots.py`: the benchmark's figure. It sits above
the training (it resolves runs through its flags and plans with its planner set-up) and the
emulation; nothing in `megatron_dip` imports it.
"""
