"""`validate`'s exit status: 3 when its verdict is outside the goals (after printing everything), 0 within
them, and 0 for an engine run whose machine drifted (its note says the errors include the drift)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stallfree.cli import main
from stallfree.validate.cli import EXIT_OUTSIDE_GOALS, exit_status

DATA = Path(__file__).parent / "data"
ROOT = Path(__file__).parents[2]


@pytest.mark.parametrize("argv", [
    ["--against", str(DATA / "run_small"), "--no-range", "--kernels", "none"],
    ["--vllm-result", str(DATA / "vllm_result_small.json")],
    ["--against", str(DATA / "silicon_small.csv"), "--kernels", "none"],
], ids=["run-folder", "vllm-result", "benchmark-csv"])
def test_a_verdict_outside_the_goals_exits_3_after_printing_it(argv, capsys):
    """Each --against form and --vllm-result: the figures and the verdict are printed, then exit 3."""
    assert main(["validate", *argv]) == EXIT_OUTSIDE_GOALS == 3
    verdicts = [line for line in capsys.readouterr().out.splitlines() if line.startswith("verdict: ")]
    assert len(verdicts) == 1
    assert verdicts[0].split(":")[1].removeprefix(" the simulator is").startswith(" outside the goals")


def test_the_readme_example_within_the_goals_exits_0(capsys):
    """README's `validate --against data/validation/llmservingsim_vllm` is within the goals: exit 0."""
    assert main(["validate", "--against", str(ROOT / "data" / "validation" / "llmservingsim_vllm"), "--no-range",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["verdict"].startswith("verdict: within the goals: ")


@pytest.mark.parametrize(("verdict", "kind", "drift", "status"), [
    ("verdict: the simulator is outside the goals: mean E2E +50.0% (outside 10%)", "engine", None, 3),
    ("verdict: the simulator is outside the goals: mean E2E +50.0% (outside 10%)", "engine", 19.0, 3),
    ("verdict: the simulator is outside the goals: mean E2E +50.0% (outside 10%)", "engine", -35.0, 0),
    ("verdict: the simulator is within the goals: mean E2E +5.0% (within 10%)", "engine", None, 0),
    ("verdict: outside the goals: mean E2E -39.4% (outside 10%)", "vllm", None, 3),
    ("verdict: outside the goals on 1 held-out rows: median APE TTFT 36.4%", "csv", None, 3),
    ("verdict: not judged: every one of the 2 rows was fitted on", "csv", None, 0),
    ("verdict: within the goals: mean E2E |8.7%| (within 10%); noise: outside the goals nowhere", "runs", None, 0),
])
def test_exit_status_by_hand(verdict, kind, drift, status):
    """Exit 3 on a verdict outside the goals, except an engine run that drifted past 20%."""
    assert exit_status({"verdict": verdict, "config": {"engine_speed_drift_pct": drift}}, kind) == status


@pytest.mark.parametrize(("drift", "status"), [(2.0, 3), (35.0, 0)], ids=["steady", "drifted"])
def test_the_engine_run_exits_3_unless_the_machine_drifted(drift, status, capsys, monkeypatch):
    """The engine run (its result stood in for): a verdict outside the goals exits 3 after the JSON is printed;
    with the machine's speed drifted by more than 20% between the halves it exits 0 (the errors include it)."""
    pytest.importorskip("torch")
    import stallfree.validate.run as run

    means = {"mean_e2e_ms": 100.0, "mean_ttft_ms": 10.0, "mean_tpot_ms": 5.0}
    config = {"model": "m", "device": "cpu", "dtype": "float32", "threads": 1, "requests": 8, "token_budget": 128,
              "max_seqs": 16, "total_wall_s": 1.0, "engine_speed_drift_pct": drift}
    res = {"engine": means, "simulator": {k: 2 * v for k, v in means.items()}, "error": {"requests": 4},
           "config": config, "notes": []}
    monkeypatch.setattr(run, "run_validate", lambda cfg, out, save_gpu: res)
    assert main(["validate", "--json"]) == status
    out = json.loads(capsys.readouterr().out)
    assert out["verdict"].startswith("verdict: the simulator is outside the goals: mean E2E +100.0% (outside 10%")
