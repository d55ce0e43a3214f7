"""Plots a person reads without the code: titled with workload and replica, files named after the mode
and KV policy actually run, the KV panel's word after the KV policy."""

from __future__ import annotations

import pytest

from stallfree.sim.experiment import run_experiment, run_tag
from stallfree.sim.plots import plot_context
from stallfree.sim.setup import HardwareOptions, Setup, WorkloadOptions
from stallfree.sim.writers import write_experiment

pytest.importorskip("matplotlib")


def _setup(scheduler: str = "reserve") -> Setup:
    return Setup(
        WorkloadOptions(synthetic="poisson", rate=5.0, prompt_len="uniform:50,400", output_len="uniform:5,40",
                        num_requests=60),
        HardwareOptions(),
        scheduler=scheduler,
    )


def test_plot_context_names_workload_replica_and_budget():
    """The title line names the workload, rate scale, model, TP x GPU, dtype, KV and the budget."""
    study = run_experiment(_setup(), budget=512)
    text = plot_context(study.header)
    for part in ("poisson", "60 requests at rate x1", "llama-3.3-70b", "4 x h100-sxm", "fp8", "KV ", "budget 512"):
        assert part in text, part
    assert plot_context(study.header, "budgets 256, 512").endswith("budgets 256, 512")


@pytest.mark.parametrize(("scheduler", "tag"), [("reserve", "chunked-reserve"), ("paged", "chunked-paged")])
def test_files_are_named_after_mode_and_kv_policy(tmp_path, scheduler, tag):
    """--out names the per-run files by batching mode and KV policy (a paged run is not 'chunked' alone)."""
    study = run_experiment(_setup(scheduler), budget=512)
    assert run_tag(study.results[0]) == tag
    names = write_experiment(tmp_path, study)
    assert f"requests-{tag}.csv" in names and f"steps-{tag}.csv" in names
    for name in ("cdf.png", "timeline.png"):
        assert (tmp_path / name).stat().st_size > 10_000


def test_kv_panel_says_reserved_or_used(tmp_path, monkeypatch):
    """The timeline's KV axis says 'reserved' for the reservation scheduler and 'used' for the paged one."""
    import matplotlib.figure

    seen: list[str] = []
    original = matplotlib.figure.Figure.savefig

    def spy(self, *args, **kwargs):
        seen.extend(ax.get_ylabel() for ax in self.axes)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", spy)
    from stallfree.sim.plots import plot_timeline

    plot_timeline(run_experiment(_setup("reserve"), budget=512).results, tmp_path / "a.png")
    plot_timeline(run_experiment(_setup("paged"), budget=512).results, tmp_path / "b.png")
    assert "KV reserved (% of capacity)" in seen and "KV used (% of capacity)" in seen
