"""benchmarks/scale.py names the keys at which two trees' `--json` outputs differ, so that a figure that
changed on purpose (a capacity estimate) is told apart from a run that changed."""

from __future__ import annotations

from factories import load_benchmark


def test_differences_name_each_key_path():
    scale = load_benchmark("scale")
    old = {"header": {"requests": 10}, "runs": [{"capacity_req_s": 355.8, "load": 0.844, "p99": 1.0}]}
    new = {"header": {"requests": 10}, "runs": [{"capacity_req_s": 360.5, "load": 0.833, "p99": 1.0}]}
    assert scale._differences(old, new) == ["runs[0].capacity_req_s", "runs[0].load"]
    assert scale._differences(old, old) == []
    assert scale._differences({"runs": [1, 2]}, {"runs": [1]}) == ["runs"]
    assert scale._differences({"a": 1}, {"b": 1}) == ["a", "b"]
    # wall times are left out before the comparison
    assert scale._figures('{"sim_wall_s": 3.1, "x": 1}') == {"x": 1}
