"""What a simulation is run on: workloads (real traces and their readers, synthetic arrivals, sessions),
the typed options and the Setup built from them, the pricing of steps (cost model, the engine's profile
and scheduling defaults), and GPU prices.

Imports allowed: the standard library, stallfree.core, stallfree.costmodel, stallfree._files,
stallfree.sim.defaults; the Setup also builds the run's ReplicaConfig, LoRA and load from stallfree.sim.run.

Modules: engine_behaviour, engine_profile, options, prices, pricing, session_traces, sessions, setup, synthetic,
traces, workload.
"""
