"""The run: the one event loop on a simulated clock, the replicas it drives, their scheduler and cost model,
the routers that share requests between replicas, the load a run offers (open or closed loop, sessions),
and the topologies built on the loop: one replica, a cluster, disaggregated prefill and decode.

Imports allowed: the standard library, stallfree.core, stallfree.costmodel, stallfree.sim.defaults and
the workload modules of stallfree.sim.inputs (what a run replays).

Modules: baselines, cluster, config, costs, disagg, disagg_link, load, loop, lora, replica, result, routers,
session_run, simulator, time_budget.
"""
