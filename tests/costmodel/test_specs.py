"""Tests of the GPU and model specs: presets, names, user files and Hugging Face configs."""

from __future__ import annotations

import json
import re
from importlib import resources

import pytest

from stallfree.costmodel import (
    CostModelError,
    get_gpu,
    get_model,
    list_gpus,
    list_models,
    load_gpu_file,
    load_model_file,
    model_from_hf_config,
)

REQUIRED_GPUS = ["h100-sxm", "h100-pcie", "h200", "a100-sxm-80gb", "l40s", "b200", "mi300x"]
REQUIRED_MODELS = [
    "llama-3.1-8b",
    "llama-3.3-70b",
    "llama-3.1-405b",
    "llama-2-7b",
    "llama-2-70b",
    "mistral-7b",
    "qwen2.5-7b",
    "qwen2.5-72b",
    "mixtral-8x7b",
    "yi-34b",
]


def _model_data() -> dict:
    text = resources.files("stallfree.costmodel").joinpath("data/models.json").read_text()
    return json.loads(text)["models"]


def test_required_presets_present():
    """Every GPU and model the cost model promises is a preset."""
    assert set(REQUIRED_GPUS) <= set(list_gpus())
    assert set(REQUIRED_MODELS) <= set(list_models())


@pytest.mark.parametrize("key", sorted(_model_data()), ids=str)
def test_parameter_counts_match_published(key):
    """The counts worked out from the dimensions equal the published counts stored beside them."""
    m, want = get_model(key), _model_data()[key]["check_params"]
    got = {
        "total": m.total_params,
        "active": m.active_params,
        "layer": m.layer_params,
        "active_layer": m.active_layer_params,
        "embed": m.embed_params,
        "lm_head": m.lm_head_params,
    }
    assert got == want


def test_mixtral_active_parameters():
    """Mixtral 8x7B runs 12.88B of its 46.70B parameters per token (2 of 8 experts)."""
    m = get_model("mixtral-8x7b")
    assert (m.total_params, m.active_params) == (46_702_792_704, 12_879_925_248)


def test_llama_70b_layer_params_by_hand():
    """Llama 70B layer: 2*8192*8192 + 2*8192*1024 + 3*8192*28672 + 2*8192 = 855,654,400 weights."""
    assert get_model("llama-3.3-70b").layer_params == 80 * 855_654_400


def test_every_preset_has_sources():
    """Each preset carries at least one source, and each GPU says where its link figure comes from."""
    for k in list_gpus():
        g = get_gpu(k)
        assert g.sources and g.link_source
    for k in list_models():
        assert get_model(k).sources


def test_h100_sxm_dense_peaks():
    """H100 SXM: 989.4 / 1,978.9 dense TFLOP/s (bf16 / fp8), 3,350 GB/s, 450 GB/s per direction on NVLink4."""
    g = get_gpu("h100-sxm")
    assert g.peak_flops("bf16") == pytest.approx(989.4e12)
    assert g.peak_flops("fp8") == pytest.approx(1978.9e12)
    assert g.mem_bw_bytes_per_s == pytest.approx(3.35e12)
    assert g.link_bw_bytes_per_s == pytest.approx(450e9)
    assert get_gpu("a100").peak_flops("fp8") is None


@pytest.mark.parametrize("name", ["H100_SXM", "h100-sxm", " h100_sxm ", "H100 SXM"], ids=str)
def test_names_treat_dash_and_underscore_alike(name):
    """GPU names ignore case and read '_' and spaces as '-'."""
    assert get_gpu(name).key == "h100-sxm"


def test_model_alias_and_underscore():
    """Model names read '_' as '-' and aliases resolve to the preset."""
    assert get_model("LLAMA_3.3_70B").key == "llama-3.3-70b"
    assert get_model("llama-3-8b").key == "llama-3.1-8b"


def test_mi300x_mesh_bandwidth_grows_with_group():
    """MI300X's mesh gives (n-1) x 64 GB/s per direction, capped at 448 GB/s."""
    g = get_gpu("mi300x")
    assert g.allreduce_bw(2) == pytest.approx(64e9)
    assert g.allreduce_bw(4) == pytest.approx(192e9)
    assert g.allreduce_bw(8) == pytest.approx(448e9)


@pytest.mark.parametrize(
    "getter,name,kind", [(get_gpu, "tpu-v9", "GPU"), (get_model, "gpt-9", "model")], ids=["gpu", "model"]
)
def test_unknown_name_lists_known(getter, name, kind):
    """An unknown name raises CostModelError (a ValueError) that lists the known names."""
    with pytest.raises(ValueError, match=f"unknown {kind} '{name}'.*known") as info:
        getter(name)
    assert isinstance(info.value, CostModelError)
    known = "h100-sxm" if kind == "GPU" else "llama-3.3-70b"
    assert known in str(info.value)


def test_hf_config_matches_preset():
    """A Llama 3.1 8B Hugging Face config.json gives the preset's parameter counts."""
    config = {
        "model_type": "llama",
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
    }
    m = model_from_hf_config("mine", config)
    assert m.total_params == get_model("llama-3.1-8b").total_params == 8_030_261_248


def test_hf_config_qwen2_bias_and_mixtral_experts():
    """Qwen2 configs get q/k/v biases (7.616B) and Mixtral configs their experts (12.88B active)."""
    qwen = model_from_hf_config(
        "q",
        {
            "model_type": "qwen2",
            "hidden_size": 3584,
            "num_hidden_layers": 28,
            "num_attention_heads": 28,
            "num_key_value_heads": 4,
            "intermediate_size": 18944,
            "vocab_size": 152064,
        },
    )
    assert qwen.total_params == 7_615_616_512
    mix = model_from_hf_config(
        "m",
        {
            "model_type": "mixtral",
            "hidden_size": 4096,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "intermediate_size": 14336,
            "vocab_size": 32000,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
        },
    )
    assert mix.active_params == 12_879_925_248


def test_model_file_and_gpu_file(tmp_path):
    """User JSON files load: a config.json by its folder's name, a GPU in the gpus.json entry format."""
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps(
            {
                "hidden_act": "silu",
                "hidden_size": 1024,
                "num_hidden_layers": 2,
                "num_attention_heads": 8,
                "intermediate_size": 4096,
                "vocab_size": 1000,
            }
        )
    )
    m = get_model(str(folder / "config.json"))
    assert m.key == "my-model" and m.num_kv_heads == 8 and m.head_dim == 128
    assert m.layer_params == 2 * (4 * 1024 * 1024 + 3 * 1024 * 4096 + 2 * 1024)
    gpu_file = tmp_path / "mygpu.json"
    gpu_file.write_text(
        json.dumps({"peak_tflops": {"bf16": 100}, "mem_bw_GBps": 1000, "mem_GB": 24, "link_GBps": 25})
    )
    g = load_gpu_file(gpu_file)
    assert (g.key, g.bf16_flops_per_s, g.fp8_flops_per_s, g.mem_bytes) == ("mygpu", 100e12, None, 24e9)


@pytest.mark.parametrize(
    "bad",
    [{"num_layers": 0}, {"hidden_size": -4}, {"num_kv_heads": 3}, {"num_experts": 2, "experts_per_token": 3}],
    ids=["zero-layers", "negative-hidden", "kv-not-dividing", "k-above-e"],
)
def test_bad_model_file_is_explained(tmp_path, bad):
    """A model file with a zero, negative or inconsistent size raises CostModelError naming the field."""
    data = {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "intermediate_size": 128, "vocab_size": 10}
    data.update(bad)
    path = tmp_path / "m.json"
    path.write_text(json.dumps(data))
    with pytest.raises(CostModelError, match="model 'm'"):
        load_model_file(path)


def test_bad_gpu_file_is_explained(tmp_path):
    """A GPU file with a missing key or a zero bandwidth raises CostModelError naming it."""
    path = tmp_path / "g.json"
    path.write_text(json.dumps({"peak_tflops": {"bf16": 1}, "mem_GB": 1, "link_GBps": 1}))
    with pytest.raises(CostModelError, match="missing key 'mem_bw_GBps'"):
        load_gpu_file(path)
    path.write_text(json.dumps({"peak_tflops": {"bf16": 1}, "mem_bw_GBps": 0, "mem_GB": 1, "link_GBps": 1}))
    with pytest.raises(CostModelError, match="mem_bw_GBps must be a positive number, got 0"):
        load_gpu_file(path)


GOOD_GPU = {"name": "g", "peak_tflops": {"bf16": 989.4, "fp8": 1978.9}, "mem_bw_GBps": 3350, "mem_GB": 80,
            "link_GBps": 450}


@pytest.mark.parametrize(
    "key,value,message",
    [
        ("w4a16_kernels", "false", "w4a16_kernels must be true or false, got 'false'"),
        ("w4a16_kernels", 0, "w4a16_kernels must be true or false, got 0"),
        ("peak_tflops", 989, "peak_tflops must be an object, got 989"),
        ("peak_tflops", {"bf16": "989"}, "peak_tflops['bf16'] must be a positive number, got '989'"),
        ("peak_tflops", {"bf16": 989, "fp8": True}, "peak_tflops['fp8'] must be a positive number, got True"),
        ("peak_tflops", {"bf16": 989, "FP8": 1978}, "peak_tflops has unknown key 'FP8'; known: bf16, fp16, fp8, "
         "int8, fp4"),
        ("mem_GB", "abc", "mem_GB must be a positive number, got 'abc'"),
        ("mem_bw_GBps", -1, "mem_bw_GBps must be a positive number, got -1"),
        ("link_GBps", None, "link_GBps must be a positive number, got None"),
        ("internode_GBps", 0, "internode_GBps must be a positive number, got 0"),
        ("host_link_latency_us", -5, "host_link_latency_us must be a number >= 0, got -5"),
        ("gpus_per_node", 2.5, "gpus_per_node must be an integer >= 1, got 2.5"),
        ("sources", 5, "sources must be a list of strings, got 5"),
        ("aliases", "g2", "aliases must be a list of strings, got 'g2'"),
        ("name", 7, "name must be a string, got 7"),
        ("calibration", {"source": "s", "model": "m", "tp": 1, "linear_flops_per_token_per_gpu": 1, "mfu": "0.5"},
         "calibration: mfu must be a number >= 0, got '0.5'"),
        ("calibration", {"source": "s", "model": "m", "tp": "1", "linear_flops_per_token_per_gpu": 1},
         "calibration: tp must be an integer >= 1, got '1'"),
    ],
    ids=lambda v: v if isinstance(v, str) and len(v) < 24 else None,
)
def test_gpu_file_value_of_the_wrong_type_names_key_and_value(tmp_path, key, value, message):
    """A GPU file's value of the wrong JSON type or out of range is refused with one line naming the key as
    the file spells it and the value as written (a string "false" is not read as true; no Python error
    text, no internal field name or unit)."""
    path = tmp_path / "g.json"
    path.write_text(json.dumps(dict(GOOD_GPU, **{key: value})))
    with pytest.raises(CostModelError) as info:
        load_gpu_file(path)
    assert str(info.value) == f"GPU 'g': {message}"


def test_gpu_file_with_good_values_loads(tmp_path):
    """The same file with good values loads, at the figures it gives."""
    path = tmp_path / "g.json"
    path.write_text(json.dumps(dict(GOOD_GPU, w4a16_kernels=False, host_link_latency_us=0)))
    g = load_gpu_file(path)
    assert (g.bf16_flops_per_s, g.fp16_flops_per_s, g.fp8_flops_per_s) == (989.4e12, 989.4e12, 1978.9e12)
    assert (g.mem_bw_bytes_per_s, g.mem_bytes, g.w4a16_kernels, g.host_link_latency_s) == (3350e9, 80e9, False, 0)


@pytest.mark.parametrize(
    "key,value,message",
    [
        ("tie_word_embeddings", "false", "tie_word_embeddings must be true or false, got 'false'"),
        ("gated_mlp", 1, "gated_mlp must be true or false, got 1"),
        ("aliases", 5, "aliases must be a list of strings, got 5"),
        ("sources", [1], "sources must be a list of strings, got [1]"),
        ("name", None, "name must be a string, got None"),
        ("norm_params_per_layer", "8", "norm_params_per_layer must be an integer >= 0, got '8'"),
    ],
    ids=lambda v: v if isinstance(v, str) and len(v) < 24 else None,
)
def test_model_file_value_of_the_wrong_type_names_key_and_value(tmp_path, key, value, message):
    """A model file's boolean, string or list of the wrong JSON type is refused naming key and value."""
    data = {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "intermediate_size": 128, "vocab_size": 10}
    path = tmp_path / "m.json"
    path.write_text(json.dumps(dict(data, **{key: value})))
    with pytest.raises(CostModelError) as info:
        load_model_file(path)
    assert str(info.value) == f"model 'm': {message}"


PHI2 = {
    "model_type": "phi",
    "architectures": ["PhiForCausalLM"],
    "hidden_act": "gelu_new",
    "hidden_size": 2560,
    "intermediate_size": 10240,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "vocab_size": 51200,
    "tie_word_embeddings": False,
}


def test_hf_config_plain_mlp_has_no_gate():
    """phi-2's MLP has two matrices: 2 x h x f per layer, not 3 x h x f (which would add 0.84B weights)."""
    m = model_from_hf_config("phi-2", PHI2)
    assert not m.gated_mlp
    assert m.expert_params_per_layer == 2 * 2560 * 10240
    gated = model_from_hf_config("phi-2", dict(PHI2, model_type="llama"))
    assert gated.total_params - m.total_params == 32 * 2560 * 10240
    neox = model_from_hf_config("neox", dict(PHI2, model_type="gpt_neox", hidden_act="gelu"))
    assert not neox.gated_mlp


def test_hf_config_null_tie_is_untied_and_a_string_is_refused():
    """A config.json's `"tie_word_embeddings": null` is transformers' unset (untied: the LM head's own
    2560 x 51200 weights counted); a string is refused, naming the field."""
    untied = model_from_hf_config("phi-2", PHI2)
    assert model_from_hf_config("phi-2", dict(PHI2, tie_word_embeddings=None)).total_params == untied.total_params
    tied = model_from_hf_config("phi-2", dict(PHI2, tie_word_embeddings=True))
    assert untied.total_params - tied.total_params == 2560 * 51200
    with pytest.raises(CostModelError, match="tie_word_embeddings must be true or false, got 'yes'"):
        model_from_hf_config("phi-2", dict(PHI2, tie_word_embeddings="yes"))


def test_hf_config_unknown_kind_uses_activation_or_refuses():
    """An unknown model_type is gated when its activation is SiLU and refused otherwise, naming the fields."""
    assert model_from_hf_config("x", dict(PHI2, model_type="newarch", hidden_act="silu")).gated_mlp
    with pytest.raises(CostModelError, match="model_type 'newarch' .* hidden_act 'gelu'"):
        model_from_hf_config("x", dict(PHI2, model_type="newarch", hidden_act="gelu"))


@pytest.mark.parametrize(
    "field,value",
    [("decoder_sparse_step", 2), ("moe_layer_freq", 2), ("mlp_only_layers", [0, 3]),
     ("shared_expert_intermediate_size", 5632)],
    ids=["sparse-step-2", "layer-freq-2", "mlp-only-layers", "qwen2-moe"],
)
def test_hf_config_refuses_what_it_cannot_price(field, value):
    """MoE variants the formulas do not cover (MoE every other layer, a shared expert of its own
    size) are refused, naming the field."""
    config = dict(PHI2, model_type="deepseek_v3", hidden_act="silu", num_experts=64, num_experts_per_tok=6)
    config[field] = value
    with pytest.raises(CostModelError, match=re.escape(f"field '{field}' = {value}")):
        model_from_hf_config("moe", config)


@pytest.mark.parametrize(
    "key,bf16,fp8,bw,gb",
    [
        ("a40", 149.7, None, 696, 48),
        ("l4", 121.0, 242.5, 300, 24),
        ("a10g", 70.0, None, 600, 24),
        ("l40", 181.05, 362.0, 864, 48),
        ("rtx-4090", 165.2, 330.3, 1008, 24),
    ],
    ids=lambda v: getattr(v, "__name__", str(v)),
)
def test_new_gpu_presets(key, bf16, fp8, bw, gb):
    """The A40, L4, A10G, L40 and RTX 4090 presets carry their datasheet figures (dense) and sources."""
    g = get_gpu(key)
    assert g.peak_flops("bf16") == pytest.approx(bf16 * 1e12)
    assert g.peak_flops("fp8") == (None if fp8 is None else pytest.approx(fp8 * 1e12))
    assert (g.mem_bw_bytes_per_s, g.mem_bytes) == (bw * 1e9, gb * 1e9)
    assert g.link_bw_bytes_per_s == 32e9 and g.sources and g.link_source


def test_group_spanning_nodes_uses_the_network():
    """A TP group larger than a node all-reduces at the 50 GB/s network (400 Gb/s per GPU), not NVLink."""
    g = get_gpu("h100-sxm")
    assert g.allreduce_bw(8) == 450e9 and g.allreduce_bw(16) == 50e9
    assert g.p2p_bw(True) == 50e9 and g.p2p_bw(False) == 450e9


@pytest.mark.parametrize(
    "getter,typo,meant",
    [(get_model, "llama-3.1-8", "llama-3.1-8b"), (get_model, "qwen3-30b-a3", "qwen3-30b-a3b"),
     (get_gpu, "h10", "h100-sxm"), (get_gpu, "mi300", "mi300x")],
    ids=lambda v: getattr(v, "__name__", str(v)),
)
def test_a_typo_suggests_the_close_preset(getter, typo, meant):
    """A near miss names the closest preset (difflib); a far one suggests nothing."""
    with pytest.raises(CostModelError, match=f"unknown .* '{typo}' \\(did you mean '{meant}'\\?\\)"):
        getter(typo)
    with pytest.raises(CostModelError) as info:
        getter("zzzz-9")
    assert "did you mean" not in str(info.value)
