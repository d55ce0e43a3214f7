"""Benchmark rows of the newer MoE models: their Hugging Face names map onto our presets with the
checkpoints' weight formats, and a row's moe_ep_size reaches the cost model as ep."""

from __future__ import annotations

from pathlib import Path

from stallfree.sim.inputs.engine_profile import load_profile
from stallfree.validate.hardware import model_preset, pricing
from stallfree.validate.silicon import read_rows, replay_row

HEADER = ("id,silicon_data_source,backend,backend_version,model_path,system,precision,mode,isl,osl,gemm_quant_mode,"
          "moe_quant_mode,batch_size,tp_size,pp_size,attention_dp_size,moe_tp_size,moe_ep_size,silicon_ttft_ms,"
          "silicon_tpot_ms\n")


def test_new_model_names_map_onto_presets_with_their_formats() -> None:
    """DeepSeek-R1 and -V3 are the deepseek-v3 preset in FP8, gpt-oss its MXFP4 experts whatever the row
    calls them, Qwen3-235B-A22B-FP8 the qwen3-235b-a22b preset in FP8."""
    assert model_preset("deepseek-ai/DeepSeek-R1", "bfloat16") == ("deepseek-v3", "fp8")
    assert model_preset("deepseek-ai/DeepSeek-V3") == ("deepseek-v3", "fp8")
    assert model_preset("openai/gpt-oss-120b", "bfloat16") == ("gpt-oss-120b", "mxfp4")
    assert model_preset("Qwen/Qwen3-235B-A22B-FP8") == ("qwen3-235b-a22b", "fp8")


def test_a_rows_expert_parallelism_reaches_the_cost_model(tmp_path: Path) -> None:
    """moe_ep_size 4 is read (an empty one is 1) and priced as ep 4: the replay reports it and its TPOT
    differs from the same row at ep 1 by the all-to-all the roofline adds."""
    csv = tmp_path / "rows.csv"
    csv.write_text(HEADER
                   + "a,src; silicon_concurrency=4,trtllm,1.0,Qwen/Qwen3-235B-A22B-FP8,h200_sxm,fp8,agg,512,8,fp8,fp8,"
                     "4,4,1,,1,4,100.0,10.0\n"
                   + "b,src; silicon_concurrency=4,trtllm,1.0,Qwen/Qwen3-235B-A22B-FP8,h200_sxm,fp8,agg,512,8,fp8,fp8,"
                     "4,4,1,,4,,100.0,10.0\n", encoding="utf-8")
    ep4, ep1 = read_rows(csv)
    assert (ep4.moe_ep, ep1.moe_ep) == (4, 1)
    none = load_profile("none")
    assert pricing("qwen3-235b-a22b", "h200", 4, "fp8", none, "none", ep=4).base.ep == 4
    a = replay_row(ep4, none, "none", requests_per_row=1)
    b = replay_row(ep1, none, "none", requests_per_row=1)
    assert (a["ep"], b["ep"]) == (4, 1)
    assert a["sim_tpot_ms"] > b["sim_tpot_ms"]


def test_a_row_whose_experts_span_more_gpus_than_its_tp_is_not_replayed(tmp_path: Path) -> None:
    """tp_size 2 with moe_tp_size 4 (attention_dp_size blank): 4 GPUs hold the experts, so two attention
    ranks are implied; the row is refused with the figures rather than priced on 2 GPUs."""
    import pytest

    csv = tmp_path / "rows.csv"
    csv.write_text(HEADER + "a,src; silicon_concurrency=4,vllm,0.12.0,Qwen/Qwen3-235B-A22B-FP8,h200_sxm,fp8,agg,512,8,"
                   "fp8,fp8,4,2,1,,4,1,100.0,10.0\n", encoding="utf-8")
    (row,) = read_rows(csv)
    with pytest.raises(ValueError, match="moe_tp_size 4 x moe_ep_size 1 = 4 GPUs against tp_size 2"):
        replay_row(row, load_profile("none"), "none", requests_per_row=1)


def test_a_dense_row_with_moe_sizes_one_is_replayed(tmp_path: Path) -> None:
    """Qwen3-32B (dense) at tp_size 2 with moe_tp_size 1 x moe_ep_size 1, as the package's dense rows are
    written: 1 GPU is not more than tp's 2, nothing implies attention data parallel, so the row replays
    on 2 GPUs."""
    csv = tmp_path / "rows.csv"
    csv.write_text(HEADER + "a,src; silicon_concurrency=4,vllm,0.12.0,Qwen/Qwen3-32B,h100_sxm,bf16,agg,512,8,"
                   "bf16,bf16,4,2,1,,1,1,100.0,10.0\n", encoding="utf-8")
    (row,) = read_rows(csv)
    out = replay_row(row, load_profile("none"), "none", requests_per_row=1)
    assert out["tp"] == 2 and out["sim_ttft_ms"] > 0


def test_a_row_with_attention_data_parallel_is_replayed(tmp_path: Path) -> None:
    """DeepSeek-R1 on 8 H200s as attention_dp_size 8 of tp_size 1, moe_ep_size 8 (TensorRT-LLM's layout): the
    row is replayed, not skipped, on one replica priced at dp_attention 8 and ep 8, whose KV capacity is the
    8 ranks' (derived_kv_tokens of that cost model)."""
    from stallfree.costmodel import CostModel, get_gpu, get_model
    from stallfree.validate.hardware import derived_kv_tokens

    csv = tmp_path / "rows.csv"
    csv.write_text(HEADER + "a,src; silicon_concurrency=16,trtllm,1.3.0rc20,deepseek-ai/DeepSeek-R1,h200_sxm,fp8,agg,"
                   "512,4,fp8_block,fp8_block,2,1,1,8,1,8,300.0,20.0\n", encoding="utf-8")
    (row,) = read_rows(csv)
    assert (row.tp, row.attention_dp, row.moe_ep, row.concurrency) == (1, 8, 8, 16)
    none = load_profile("none")
    price = pricing("deepseek-v3", "h200", 1, "fp8", none, "none", ep=8, dp_attention=8)
    assert (price.base.dp_attention, price.base.ep) == (8, 8)
    out = replay_row(row, none, "none", requests_per_row=1)
    cm = CostModel(get_model("deepseek-v3"), get_gpu("h200"), 1, "fp8", ep=8, dp_attention=8)
    assert out["kv_tokens"] == derived_kv_tokens(cm, cm.gpu.mem_bytes, 0.9, 16)
    assert (out["dp_attention"], out["layout"]) == (8, "tp1 ep8 dp8")
    assert out["sim_ttft_ms"] > 0 and out["sim_tpot_ms"] > 0


def test_fp4_rows_are_priced_in_nvfp4_and_a_dp_rows_batch_is_per_rank(tmp_path: Path) -> None:
    """precision fp4 is NVFP4 (DeepSeek-R1's NVFP4 checkpoint) except where the name fixes MXFP4 (gpt-oss); fp8
    stays the checkpoint's FP8. Without silicon_concurrency an aggregated row's concurrency is batch_size x
    attention_dp_size (the package's batch is one rank's): 3 x 4 = 12."""
    from stallfree.validate.silicon import row_weights

    assert model_preset("nvidia/DeepSeek-R1-NVFP4") == ("deepseek-v3", "nvfp4")
    csv = tmp_path / "rows.csv"
    csv.write_text(HEADER
                   + "a,src,trtllm,1.0,deepseek-ai/DeepSeek-R1,b200_sxm,fp4,agg,512,8,nvfp4,nvfp4,3,1,1,4,1,4,1,1\n"
                   + "b,src,trtllm,1.0,openai/gpt-oss-120b,b200_sxm,fp4,agg,512,8,fp4,fp4,3,1,1,,1,1,1,1\n"
                   + "c,src,trtllm,1.0,deepseek-ai/DeepSeek-R1,b200_sxm,fp8,agg,512,8,fp8,fp8,3,8,1,,1,8,1,1\n",
                   encoding="utf-8")
    dsr1, oss, fp8 = read_rows(csv)
    assert row_weights(dsr1) == ("deepseek-v3", "nvfp4")
    assert row_weights(oss) == ("gpt-oss-120b", "mxfp4")
    assert row_weights(fp8) == ("deepseek-v3", "fp8")
    assert (dsr1.concurrency, oss.concurrency, fp8.concurrency) == (12, 3, 3)


def test_an_int4_kimi_k25_row_is_kernel_priced_from_its_nested_config(tmp_path: Path) -> None:
    """Kimi-K2.5's bundled config.json nests its DeepSeek-V3-shaped language model under text_config: the row's
    precision int4 is priced in int4 and the whole file is handed to the package, whose DeepSeek class builds its
    MLA graph (before, the backend wrote a config from the spec and refused MLA). Its step equals the package's
    own estimator of the same tables; its checkpoint leaves attention in bf16 (INT4 routed experts only)."""
    import pytest

    from stallfree.costmodel.kernels import kernels_installed
    from stallfree.validate.silicon import row_weights

    if not kernels_installed():
        pytest.skip("the optional package aiconfigurator-core is not installed")
    csv = tmp_path / "rows.csv"
    csv.write_text(HEADER + "a,src; silicon_concurrency=4,vllm,0.18.0,moonshotai/Kimi-K2.5,h200_sxm,int4,agg,1024,"
                   "1024,int4_wo,int4_wo,4,8,1,1,8,1,124.3,10.31\n", encoding="utf-8")
    (row,) = read_rows(csv)
    name, dtype = row_weights(row)
    assert name.endswith("moonshotai--Kimi-K2.5_config.json") and dtype == "int4"
    price = pricing(name, "h200", 8, dtype, load_profile("none"), "vllm")
    km = price.base
    assert price.provenance.startswith("measured vllm")
    handle = km.tables.handle
    assert km.decode_step_time(4, 1536) == pytest.approx(handle.decode_step_latency(4, 1535, 2) * 1e-3, rel=1e-6)
    # 1.03e12 parameters, 3.29e10 active: the published 1T / 32B
    assert round(km.roofline.model.total_params / 1e9) == 1026
    assert round(km.roofline.model.active_params / 1e9) == 33
