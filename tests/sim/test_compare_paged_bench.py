"""benchmarks/compare_paged.py --check runs the paged invariant checker (it raised AttributeError: the
script handed the simulator a checker where a scheduler with stats() was expected), and the checked
run's table is the unchecked one's."""

from __future__ import annotations

from factories import load_benchmark


def test_check_runs_the_checker_and_changes_no_figure(capsys):  # type: ignore[no-untyped-def]
    bench = load_benchmark("compare_paged")
    args = ["--num-requests", "40", "--kv-tokens", "8192"]
    assert bench.main(args) == 0
    plain = capsys.readouterr().out
    assert bench.main([*args, "--check"]) == 0
    checked = capsys.readouterr().out

    def figures(text: str) -> list[str]:  # every row but the wall times
        return [ln for ln in text.splitlines() if ln and not ln.startswith(("sim_wall_s", "KV "))]

    assert figures(checked) == figures(plain)
    assert any(ln.startswith("preemptions") for ln in figures(plain))
