"""Plots a person reads without the code: titled with workload and replica, files named after the mode
and KV policy actually run, the KV panel's word after the KV policy."""

from __future__ import annotations

import pytest

from stallfree.cli import main
from stallfree.sim.inputs.options import HardwareOptions, WorkloadOptions
from stallfree.sim.inputs.setup import Setup
from stallfree.sim.outputs import plots
from stallfree.sim.outputs.plots import plot_context
from stallfree.sim.outputs.writers import write_experiment
from stallfree.sim.studies.experiment import run_experiment, run_tag

pytest.importorskip("matplotlib")


def _setup(scheduler: str = "reserve") -> Setup:
    return Setup(
        WorkloadOptions(synthetic="poisson", rate=5.0, prompt_len="uniform:50,400", output_len="uniform:5,40",
                        num_requests=60),
        HardwareOptions(),
        {"kv_policy": scheduler},
    )


def test_plot_context_names_workload_replica_and_budget():
    """The title line names the workload, rate scale, model, TP x GPU, dtype, KV and the budget."""
    study = run_experiment(_setup(), budget=512)
    text = plot_context(study.header)
    for part in ("poisson", "60 requests at rate x1", "llama-3.3-70b", "4 x h100-sxm", "fp8", "KV ", "budget 512"):
        assert part in text, part
    assert plot_context(study.header, "budgets 256, 512").endswith("budgets 256, 512")


@pytest.mark.parametrize(("scheduler", "target", "tag"), [
    ("reserve", None, "chunked-reserve"), ("paged", None, "chunked-paged"),
    ("reserve", 0.05, "chunked-reserve-time"), ("paged", 0.05, "chunked-paged-time"),  # paged was named reserve
])
def test_files_are_named_after_mode_and_kv_policy(tmp_path, scheduler, target, tag):
    """--out names the per-run files by batching mode and KV policy (a paged run is not 'chunked' alone),
    in time-budget mode (--step-time-target) too."""
    study = run_experiment(_setup(scheduler), budget=512, step_time_target=target)
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
    from stallfree.sim.outputs.plots import plot_timeline

    plot_timeline(run_experiment(_setup("reserve"), budget=512).results, tmp_path / "a.png")
    plot_timeline(run_experiment(_setup("paged"), budget=512).results, tmp_path / "b.png")
    assert "KV reserved (% of capacity)" in seen and "KV used (% of capacity)" in seen


def _saved_axes(monkeypatch) -> list:
    """Spy on Figure.savefig: the axes of every figure saved, at the moment it is saved."""
    import matplotlib.figure

    seen: list = []
    original = matplotlib.figure.Figure.savefig

    def spy(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        seen.append(list(self.axes))
        return out

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", spy)
    return seen


def test_axis_scale_is_log_only_over_a_wide_span():
    """13,000-15,000 ms is a narrow range (linear); 20 to 3,700 ms spans 185x (log); nothing positive: linear."""
    from stallfree.sim.outputs.plots import axis_scale

    assert axis_scale([13_000.0, 14_200.0, 15_000.0]) == "linear"
    assert axis_scale([20.0, 240.0, 3_700.0]) == "log"
    assert axis_scale([10.0, 100.0]) == "log"  # exactly LOG_SPAN
    assert axis_scale([0.0, float("nan"), None]) == "linear"


def _crowded_rows() -> list[dict]:
    """Six budgets whose p99s differ by a few percent (budget labels would pile up), on three modes."""
    rows = []
    for k, mode in enumerate(("chunked", "prefill-first", "no-chunk")):
        for j, b in enumerate((256, 512, 1024, 2048, 4096, 8192)):
            rows.append({"batching": mode, "rate_scale": 1.0, "token_budget": b,
                         "p99_ttft_ms": 13_000 + 400 * j + 90 * k, "p99_tpot_ms": 60 + 6 * j + 4 * k})
    return rows


def test_tradeoff_labels_stay_inside_the_axes_and_apart(tmp_path, monkeypatch):
    """Crowded points near the left edge: every budget label lies inside the axes and no two overlap;
    a 13,000-15,000 ms TTFT axis is linear and does not say 'log scale'."""
    from stallfree.sim.outputs import plots

    boxes: list = []
    frames: list = []
    original = plots.place_labels

    def measured(fig, ax, labels):
        out = original(fig, ax, labels)
        renderer = fig.canvas.get_renderer()
        frames.append(ax.get_window_extent(renderer))
        boxes.extend(a.get_window_extent(renderer) for a in out)
        return out

    monkeypatch.setattr(plots, "place_labels", measured)
    seen = _saved_axes(monkeypatch)
    plots.plot_tradeoff(_crowded_rows(), tmp_path / "t.png")
    ax = seen[0][0]
    assert ax.get_xscale() == "linear" and ax.get_xlabel() == "p99 TTFT (ms)"
    assert ax.get_yscale() == "linear" and ax.get_ylabel() == "p99 TPOT (ms)"
    assert len(boxes) == 18
    frame = frames[0]
    for b in boxes:
        assert frame.x0 <= b.x0 + 0.5 and b.x1 <= frame.x1 + 0.5 and frame.y0 <= b.y0 + 0.5 and b.y1 <= frame.y1 + 0.5
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            assert not (a.x0 < b.x1 - 0.5 and b.x0 < a.x1 - 0.5 and a.y0 < b.y1 - 0.5 and b.y0 < a.y1 - 0.5)


def test_tradeoff_goes_log_where_the_modes_differ_tenfold(tmp_path, monkeypatch):
    """p99 TPOT from 22 ms (chunked) to 3,700 ms (prefill-first): the TPOT axis is log and says so."""
    from stallfree.sim.outputs import plots

    rows = [{"batching": "chunked", "rate_scale": 1.0, "token_budget": 512, "p99_ttft_ms": 50_000, "p99_tpot_ms": 22},
            {"batching": "prefill-first", "rate_scale": 1.0, "token_budget": 512, "p99_ttft_ms": 58_000,
             "p99_tpot_ms": 3_700}]
    seen = _saved_axes(monkeypatch)
    plots.plot_tradeoff(rows, tmp_path / "t.png")
    ax = seen[0][0]
    assert ax.get_yscale() == "log" and ax.get_ylabel() == "p99 TPOT (ms, log scale)"
    assert ax.get_xscale() == "linear"


def test_cdf_tpot_axis_goes_log_when_a_baseline_is_tenfold_slower(tmp_path, monkeypatch):
    """A chunked TPOT near 20 ms beside prefill-first's near 1,000 ms: the TPOT panel is log (the chunked
    curve is not squeezed against 0), TTFT within 3x is linear."""
    import numpy as np

    from stallfree.sim.outputs import plots

    rng = np.random.default_rng(0)
    series = [("chunked", rng.uniform(900, 1100, 200), rng.uniform(18, 24, 200)),
              ("prefill-first", rng.uniform(1000, 2500, 200), rng.uniform(600, 1500, 200))]
    seen = _saved_axes(monkeypatch)
    plots.plot_cdf_series(series, tmp_path / "c.png")
    ttft_ax, tpot_ax = seen[0][0], seen[0][1]
    assert ttft_ax.get_xscale() == "linear" and ttft_ax.get_xlabel() == "TTFT (ms)"
    assert tpot_ax.get_xscale() == "log" and tpot_ax.get_xlabel().startswith("TPOT (ms, log scale")
    lo, hi = tpot_ax.get_xlim()
    assert lo < 18 and hi > 1_400


def test_tune_names_the_choice_and_keeps_markers_visible(tmp_path, monkeypatch):
    """The chosen entry names the budget and max_seqs; its marker is a hollow ring drawn under the lines."""
    from stallfree.sim.outputs import plots

    rows = [{"token_budget": b, "max_seqs": m, "request_goodput": g, "p99_tpot_ms": t}
            for b, m, g, t in ((256, 256, 4.0, 30.0), (320, 256, 5.0, 35.0), (512, 256, 4.5, 50.0),
                               (320, 128, 5.0, 34.0), (320, 512, 4.9, 36.0))]
    best = rows[1]
    assert plots.chosen_label(best) == "chosen: budget 320, max_seqs 256"
    seen = _saved_axes(monkeypatch)
    plots.plot_tune(rows, tmp_path / "t.png", best=best, slo_ttft=1.0, slo_tpot=0.05)
    ring = [ln for ln in seen[0][0].get_lines() if ln.get_label() == "chosen: budget 320, max_seqs 256"]
    assert len(ring) == 1 and ring[0].get_markerfacecolor() == "none"
    assert ring[0].get_zorder() < min(ln.get_zorder() for ln in seen[0][0].get_lines() if ln is not ring[0])


def test_timeline_says_baselines_run_past_the_budget(tmp_path, monkeypatch):
    """The tokens-per-step panel draws the token budget and says the baselines' whole prompts exceed it."""
    from stallfree.sim import LinearCostModel, parse_length_spec, simulate, synthetic
    from stallfree.sim.outputs.plots import plot_timeline
    from stallfree.sim.run.config import legacy_scheduler_config as SchedulerConfig

    wl = synthetic(30, 50.0, parse_length_spec("uniform:150,300"), parse_length_spec("fixed:4"), seed=1)
    cost = LinearCostModel(5e-3, 20e-6)
    runs = [simulate(wl, SchedulerConfig(100_000, 128, batching=mode), cost) for mode in ("chunked", "prefill-first")]
    seen = _saved_axes(monkeypatch)
    plot_timeline(runs, tmp_path / "t.png")
    tokens_ax = seen[0][1]
    budget = [ln for ln in tokens_ax.get_lines() if str(ln.get_label()).startswith("token budget")]
    assert len(budget) == 1 and list(budget[0].get_ydata()) == [128, 128]
    assert budget[0].get_label() == "token budget 128; prefill-first steps run whole prompts past it"
    assert max(max(ln.get_ydata()) for ln in tokens_ax.get_lines() if ln not in budget) > 128


def test_simulate_plot_titles_write_a_light_rate_with_two_significant_digits(tmp_path, monkeypatch):
    """Three requests 600 s apart are offered 2 / 1,200 = 0.0017 req/s: the titles of simulate --out's CDF and
    timeline plots say so, with two significant digits as the console header does (two decimals read 0.00)."""
    titles: list[str | None] = []
    draw = plots._title

    def title(fig, what, context):
        titles.append(context)
        return draw(fig, what, context)

    monkeypatch.setattr(plots, "_title", title)
    trace = tmp_path / "light.csv"
    trace.write_text("arrival_time,prompt_len,output_len\n0,10,1\n600,10,1\n1200,10,1\n")
    assert main(["simulate", "--trace", str(trace), "--linear-cost", "1000,0", "--out", str(tmp_path / "out")]) == 0
    assert len(titles) == 2 and (tmp_path / "out" / "cdf.png").is_file()
    assert set(titles) == {"light.csv, 3 requests at rate x1 (0.0017 req/s); linear cost 1000,0 (ms, us/token, "
                           "ns/context token); KV 657,180 tokens; budget 2,048"}
