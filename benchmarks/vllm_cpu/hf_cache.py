"""An offline Hugging Face cache (HF_HOME) of the models vLLM's scheduler tests name: config.json files typed by
hand from the public configs and synthetic WordLevel tokenizers (no real vocabulary, no weights, nothing
downloaded). Used by benchmarks/vllm_cpu/make_env.sh.

Usage: python benchmarks/vllm_cpu/hf_cache.py HF_HOME
"""

import json
import sys
from pathlib import Path

HF_HOME = Path(sys.argv[1]) if len(sys.argv) > 1 else Path.home() / ".cache" / "stallfree-vllm-cpu" / "hf"
SHA = "0" * 39 + "1"

OPT = {
    "_remove_final_layer_norm": False, "activation_dropout": 0.0, "activation_function": "relu",
    "architectures": ["OPTForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 2,
    "do_layer_norm_before": True, "dropout": 0.1, "enable_bias": True, "eos_token_id": 2,
    "ffn_dim": 3072, "hidden_size": 768, "init_std": 0.02, "layer_norm_elementwise_affine": True,
    "layerdrop": 0.0, "max_position_embeddings": 2048, "model_type": "opt",
    "num_attention_heads": 12, "num_hidden_layers": 12, "pad_token_id": 1, "prefix": "</s>",
    "torch_dtype": "float16", "transformers_version": "4.21.0.dev0", "use_cache": True,
    "vocab_size": 50272, "word_embed_proj_dim": 768,
}


def tokenizer_files(vocab_size: int) -> dict[str, str]:
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    for i in range(len(vocab), vocab_size):
        vocab[f"t{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
           "unk_token": "<unk>", "pad_token": "<pad>", "model_max_length": 2048}
    return {"tokenizer.json": tok.to_str(), "tokenizer_config.json": json.dumps(cfg),
            "special_tokens_map.json": json.dumps({k: cfg[k] for k in ("bos_token", "eos_token", "unk_token",
                                                                       "pad_token")})}


def write_repo(repo: str, files: dict[str, str]) -> None:
    base = HF_HOME / "hub" / ("models--" + repo.replace("/", "--"))
    snap = base / "snapshots" / SHA
    snap.mkdir(parents=True, exist_ok=True)
    (base / "refs").mkdir(exist_ok=True)
    (base / "refs" / "main").write_text(SHA)
    for name, text in files.items():
        (snap / name).write_text(text)
    print("wrote", snap, sorted(files))



def tok(vocab_size, extra=None):
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    for i in range(len(vocab), vocab_size):
        vocab[f"t{i}"] = i
    for name, idx in (extra or {}).items():
        old = [k for k, v in vocab.items() if v == idx][0]
        del vocab[old]
        vocab[name] = idx
    t = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    if extra:
        from tokenizers import AddedToken
        t.add_special_tokens([AddedToken(k, special=True) for k in extra])
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
           "unk_token": "<unk>", "pad_token": "<pad>", "model_max_length": 32768}
    if extra and "<image>" in extra:
        cfg["extra_special_tokens"] = {"image_token": "<image>"}
    return {"tokenizer.json": t.to_str(), "tokenizer_config.json": json.dumps(cfg)}

QWEN3_06B = {"architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024,
    "initializer_range": 0.02, "intermediate_size": 3072, "max_position_embeddings": 40960,
    "max_window_layers": 28, "model_type": "qwen3", "num_attention_heads": 16, "num_hidden_layers": 28,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
    "sliding_window": None, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936}
QWEN15_7B = {"architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 11008, "max_position_embeddings": 32768, "max_window_layers": 28, "model_type": "qwen2",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936}
LLAVA = {"architectures": ["LlavaForConditionalGeneration"], "ignore_index": -100, "image_token_index": 32000,
    "model_type": "llava", "pad_token_id": 32001, "projector_hidden_act": "gelu",
    "text_config": {"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 4096, "model_type": "llama",
                    "rms_norm_eps": 1e-05, "torch_dtype": "float16", "vocab_size": 32064},
    "tie_word_embeddings": False, "torch_dtype": "float16",
    "vision_config": {"hidden_size": 1024, "image_size": 336, "intermediate_size": 4096,
                      "model_type": "clip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 24,
                      "patch_size": 14, "projection_dim": 768, "vocab_size": 32000},
    "vision_feature_layer": -2, "vision_feature_select_strategy": "default", "vocab_size": 32064}
LLAVA_PRE = {"crop_size": {"height": 336, "width": 336}, "do_center_crop": True, "do_convert_rgb": True,
    "do_normalize": True, "do_rescale": True, "do_resize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_processor_type": "CLIPImageProcessor",
    "image_std": [0.26862954, 0.26130258, 0.27577711], "processor_class": "LlavaProcessor", "resample": 3,
    "rescale_factor": 0.00392156862745098, "size": {"shortest_edge": 336}}
LLAVA_PROC = {"image_token": "<image>", "num_additional_image_tokens": 1, "patch_size": 14,
    "processor_class": "LlavaProcessor", "vision_feature_select_strategy": "default"}
QWEN3_NEXT = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next"}  # class defaults = 80B-A3B


def main() -> None:
    for repo, cfg in [("facebook/opt-125m", OPT),
                      ("facebook/opt-350m", {**OPT, "hidden_size": 1024, "ffn_dim": 4096,
                                             "num_attention_heads": 16, "num_hidden_layers": 24,
                                             "word_embed_proj_dim": 512})]:
        files = {"config.json": json.dumps(cfg, indent=2),
                 "generation_config.json": json.dumps({"_from_model_config": True, "bos_token_id": 2,
                                                       "eos_token_id": 2, "pad_token_id": 1})}
        files.update(tokenizer_files(cfg["vocab_size"]))
        write_repo(repo, files)
    write_repo("Qwen/Qwen3-0.6B", {"config.json": json.dumps(QWEN3_06B), **tok(151936)})
    write_repo("Qwen/Qwen1.5-7B", {"config.json": json.dumps(QWEN15_7B), **tok(151936)})
    write_repo("llava-hf/llava-1.5-7b-hf", {"config.json": json.dumps(LLAVA),
               "preprocessor_config.json": json.dumps(LLAVA_PRE), "processor_config.json": json.dumps(LLAVA_PROC),
               **tok(32064, {"<image>": 32000})})
    write_repo("Qwen/Qwen3-Next-80B-A3B-Instruct", {"config.json": json.dumps(QWEN3_NEXT), **tok(151936)})


if __name__ == "__main__":
    main()
