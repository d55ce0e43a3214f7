"""The model's context length: presets and config.json carry it with a source, --max-model-len overrides
it, and the simulator refuses at arrival what a server would refuse, counted by reason everywhere."""

from __future__ import annotations

import csv
import json

import pytest

from stallfree.cli import main
from stallfree.costmodel.model import get_model, list_models, model_from_hf_config
from stallfree.sim import LinearCostModel, Workload, simulate
from stallfree.sim.inputs.options import HardwareOptions, SetupError, WorkloadOptions
from stallfree.sim.inputs.setup import Setup
from stallfree.sim.outputs.records import request_records
from stallfree.sim.outputs.report import summarize_result
from stallfree.sim.run.config import legacy_scheduler_config as SchedulerConfig

# Three requests at t = 0, context length 100 tokens:
#   r0: 50 + 50 = 100, within the limit;  r1: 60 + 41 = 101, one token over;  r2: the prompt alone (120) is over.
THREE = Workload((0.0, 0.0, 0.0), (50, 60, 120), (50, 41, 5), name="three")
COST = LinearCostModel(base_s=0.010, per_token_s=0.0)  # every step 10 ms


def test_every_preset_has_a_context_length_with_its_source():
    """Each model preset names its context length (tokens) and where it comes from."""
    for key in list_models():
        spec = get_model(key)
        assert spec.context_length is not None and spec.context_length >= 2048, key
        assert spec.context_length_source, key
    assert get_model("llama-3.3-70b").context_length == 131_072
    assert get_model("llama-2-70b").context_length == 4_096


def test_config_json_max_position_embeddings_is_the_context_length():
    """A Hugging Face config.json's max_position_embeddings becomes the context length; none means unknown."""
    config = {
        "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 100, "max_position_embeddings": 8192,
    }
    spec = model_from_hf_config("tiny", config)
    assert spec.context_length == 8192 and "max_position_embeddings" in spec.context_length_source
    del config["max_position_embeddings"]
    assert model_from_hf_config("tiny", config).context_length is None


def test_hand_worked_three_requests_refused_by_default():
    """Default (vLLM's answer to a max_tokens that does not fit): r1 and r2 are refused at arrival with
    reason context_length; r0 fills the context exactly and completes: first token after the one
    prefill step (10 ms), then 49 decode steps, finishing at 500 ms."""
    res = simulate(THREE, SchedulerConfig(kv_tokens=1000, token_budget=256), COST, max_model_len=100)
    assert [rid for rid, _ in res.rejected] == [1, 2]
    assert res.rejected_by_reason == {"context_length": 2}
    assert "60 + max_new 41 = 101 tokens exceeds the model's context length 100" in res.rejected[0][1]
    summary = summarize_result(res)
    assert summary["completed"] == 1 and summary["rejected"] == 2
    assert summary["rejected_by_reason"] == {"context_length": 2}
    assert summary["mean_ttft_ms"] == pytest.approx(10.0)
    assert summary["mean_e2el_ms"] == pytest.approx(500.0)
    records = request_records(res)
    assert [r["rejected_reason"] for r in records] == [None, "context_length", "context_length"]


def test_hand_worked_three_requests_with_output_cut_to_fit():
    """cut_output_to_fit (vLLM without max_tokens): r1's max_new becomes 100 - 60 = 40 and it finishes on
    length after 40 tokens (one prefill step with r0, then 39 decodes: 400 ms); r2's prompt leaves no room
    and is still refused."""
    res = simulate(
        THREE, SchedulerConfig(kv_tokens=1000, token_budget=256), COST, max_model_len=100, cut_output_to_fit=True
    )
    assert res.rejected_by_reason == {"context_length": 1}
    assert res.max_new[1] == 40 and res.target[1] == 40
    records = request_records(res)
    assert records[1]["output_tokens"] == 40 and records[1]["finish_reason"] == "length"
    assert records[1]["e2el_ms"] == pytest.approx(400.0)
    assert records[2]["rejected_reason"] == "context_length"
    assert "leaves no room for output" in res.rejected[0][1]


def test_context_length_and_kv_capacity_are_counted_apart():
    """With KV for 90 tokens, r0 (100 tokens) can never fit the KV: kv_capacity, beside two context_length."""
    res = simulate(THREE, SchedulerConfig(kv_tokens=90, token_budget=256), COST, max_model_len=100)
    assert res.rejected_by_reason == {"context_length": 2, "kv_capacity": 1}


def test_no_limit_without_a_context_length():
    """max_model_len None (a model that does not say) refuses nothing for the context."""
    res = simulate(THREE, SchedulerConfig(kv_tokens=1000, token_budget=256), COST)
    assert res.rejected == [] and res.rejected_by_reason == {}


@pytest.fixture
def three_csv(tmp_path):
    path = tmp_path / "three.csv"
    path.write_text("arrival_time,prompt_len,output_len\n0.0,50,50\n0.0,60,41\n0.0,120,5\n")
    return path


def _argv(trace, *extra):
    return ["simulate", "--trace", str(trace), "--linear-cost", "10,0", "--kv-tokens", "1000",
            "--max-num-batched-tokens", "256",
            "--max-model-len", "100", *extra]


def test_command_reports_rejections_by_reason_in_json_table_records_and_a_warning(three_csv, tmp_path, capsys):
    """simulate --max-model-len: JSON has rejected_by_reason, the table a row per reason, the records a
    rejected_reason column, and stderr one warning line with the count and the reason."""
    assert main([*_argv(three_csv), "--json"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["runs"][0]["rejected_by_reason"] == {"context_length": 2}
    assert out["header"]["max_model_len"] == 100 and out["header"]["max_model_len_source"] == "--max-model-len"
    assert captured.err.count("\n") == 1
    assert "warning: chunked/256: rejected 2 of 3 requests (2 over the context length (context_length))" in captured.err

    records = tmp_path / "r.csv"
    assert main([*_argv(three_csv), "--records", str(records)]) == 0
    text = capsys.readouterr().out
    assert "rejected: over context length" in text and "context 100 tokens" in text
    with open(records, newline="") as fh:
        assert [row["rejected_reason"] for row in csv.DictReader(fh)] == ["", "context_length", "context_length"]


def test_command_cut_output_to_fit(three_csv, capsys):
    """--cut-output-to-fit refuses only the prompt that leaves no room."""
    assert main([*_argv(three_csv), "--cut-output-to-fit", "--json"]) == 0
    run = json.loads(capsys.readouterr().out)["runs"][0]
    assert run["rejected_by_reason"] == {"context_length": 1} and run["completed"] == 2


def test_tune_and_sweep_apply_the_context_length(three_csv, capsys):
    """tune and sweep refuse the same requests, and report them by reason in their rows."""
    assert main(["sweep", *_argv(three_csv)[1:3], "--linear-cost", "10,0", "--kv-tokens", "1000",
                 "--max-model-len", "100", "--budgets", "256", "--batching", "chunked", "--jobs", "1", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["rows"][0]
    assert row["rejected"] == 2 and row["rejected_by_reason"] == {"context_length": 2}
    code = main(["tune", *_argv(three_csv)[1:3], "--linear-cost", "10,0", "--kv-tokens", "1000",
                 "--max-model-len", "100", "--budgets", "256", "--max-seqs-candidates", "256",
                 "--slo-ttft", "1s", "--slo-tpot", "100ms", "--jobs", "1", "--json"])
    captured = capsys.readouterr()
    assert code == 3  # 2 of 3 refused: at most a third of the requests within the SLOs, under the 0.99 target
    assert json.loads(captured.out)["chosen"]["rejected_by_reason"] == {"context_length": 2}
    assert "rejected 2 of 3 requests" in captured.err


def test_setup_context_length_default_and_override():
    """Setup takes the model's context length, or --max-model-len, and notes an override above the model's."""
    opts = WorkloadOptions(num_requests=10)
    assert Setup(opts, HardwareOptions()).context_length == 131_072
    over = Setup(opts, HardwareOptions(max_model_len=200_000))
    assert over.context_length == 200_000
    assert any("VLLM_ALLOW_LONG_MAX_MODEL_LEN" in n for n in over.header()["notes"])
    with pytest.raises(SetupError, match="`max_model_len`"):
        Setup(opts, HardwareOptions(max_model_len=0))
