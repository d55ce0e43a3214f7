"""Studies made of many runs: one experiment as `simulate` runs it, sweeps (budgets, KV sizes, a CPU tier),
SLO-driven tuning and its bound, capacity planning, the fleet search across GPU types, the search of
disaggregated splits, the ranges of a figure, and the executors that run the simulations.

Imports allowed: the standard library, stallfree.core, stallfree.costmodel and the other sub-packages of
stallfree.sim (studies sit near the top: the commands use them, and of the outputs only the writers,
the study plots and the overload lines read them).

Modules: capacity, cluster_study, disagg_search, executors, experiment, fleet, kv_sweep, ranges, split_bound, sweep,
tier_sweep, tune, tune_bound, tune_report.
"""
