"""What the simulator reports and writes: summaries with vLLM's serving-benchmark keys, per-request and
per-step records, the console table, latency by prompt length, overload and verdict lines, PNG plots,
and the writer of everything under --out.

Imports allowed: the standard library, stallfree.core, stallfree.sim.run and the workload modules of
stallfree.sim.inputs; numpy, matplotlib and rich only lazily. The writers, the study plots and the overload
lines also read stallfree.sim.studies' results.

Modules: buckets, disagg_report, overload, plot_parts, plots, records, report, study_plots, table, verdict, wording,
writers.
"""
