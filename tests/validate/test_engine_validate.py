"""A small `stallfree validate` run on the bundled engine (CPU, one thread): structure and a wide bound."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from stallfree.validate.compare import METRICS, PERCENTILES  # noqa: E402
from stallfree.validate.run import ValidateConfig, run_validate  # noqa: E402


@pytest.mark.slow
def test_small_validate_run(tmp_path):
    """Eight short requests through the engine and the simulator: the same requests, the same scheduler
    configuration, every metric in both, a saved calibrated GPU, and an E2E median error under 50%
    (a bound that catches drift, not the noise of a shared machine); the caller's torch thread count is
    restored afterwards."""
    import torch

    cfg = ValidateConfig(num_requests=8, max_prompt=48, max_output=10, token_budget=64, max_seqs=8,
                         kv_tokens=4096, load=0.6, threads=1)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        res = run_validate(cfg, out=tmp_path / "out", save_gpu=tmp_path / "local.json")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert res["engine"]["requests"] == res["simulator"]["requests"] == 4  # the second half
    c = res["config"]
    assert (c["token_budget"], c["max_seqs"], c["kv_tokens"], c["requests"]) == (64, 8, 4096, 8)
    for m in METRICS:
        for q in PERCENTILES:
            assert res["engine"][f"p{q:g}_{m}_ms"] is not None and res["simulator"][f"p{q:g}_{m}_ms"] is not None
        assert res["error"][f"{m}_median_ape_pct"] is not None
    assert res["error"]["e2e_median_ape_pct"] < 50
    saved = json.loads((tmp_path / "local.json").read_text())
    assert saved["calibration"]["source"].startswith("stallfree validate")
    assert {p.name for p in (tmp_path / "out").iterdir()} == {
        "requests.csv", "engine_steps.csv", "local_gpu.json", "validate.png"
    }
