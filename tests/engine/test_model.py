"""The decoder on a Hugging Face directory: a tiny random Llama with grouped-query attention, an
untied LM head and Llama 3 RoPE scaling gives transformers' logits and greedy tokens."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from stallfree.engine import LLMEngine, ModelLoadError, SamplingParams
from stallfree.engine.batch import BatchEntry, build_flat_batch
from stallfree.engine.kv_cache import KVCache
from stallfree.engine.weights import load_checkpoint

transformers = pytest.importorskip("transformers")

TINY = dict(
    vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
    rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False, eos_token_id=2,
    bos_token_id=1,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, checkpoint):
    """A Hugging Face directory with a seeded random tiny Llama and SmolLM2's tokenizer."""
    path = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).eval()
        m.save_pretrained(path, safe_serialization=True)
    checkpoint.tokenizer._tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "chat_template": checkpoint.tokenizer.chat_template}))
    return path, m


def test_hf_directory_config_is_read(tiny_dir):
    """config.json's shape, untied head and RoPE scaling come through."""
    path, _ = tiny_dir
    ck = load_checkpoint(path)
    c = ck.config
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size) == (2, 4, 2, 16, 64)
    assert not c.tie_embeddings and c.rope_scaling["rope_type"] == "llama3"
    assert ck.name == path.name and ck.tokenizer.eos_token_ids == (2,)


def test_tiny_logits_match_transformers(tiny_dir):
    """Full-pass logits of 40 tokens (beyond the 32-token original context) match within 1e-4."""
    path, ref = tiny_dir
    ck = load_checkpoint(path)
    from stallfree.engine.model import LlamaModel

    model = LlamaModel(ck.config, ck.tensors)
    ids = list(range(100, 140))
    kv = KVCache(2, 2, 16, 4, 16, torch.float32, torch.device("cpu"))
    batch = build_flat_batch([BatchEntry(ids, 0, [0, 1, 2], "all")], 16, torch.device("cpu"))
    ours = model.forward(batch, kv)
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    assert (ours - want).abs().max().item() < 1e-4


def test_tiny_engine_greedy_matches_transformers_generate(tiny_dir):
    """The engine, chunking at budget 5, generates what transformers' greedy generate does."""
    path, ref = tiny_dir
    eng = LLMEngine.from_pretrained(path, token_budget=5, max_seqs=2, kv_tokens=256, device="cpu",
                                    dtype="float32")
    ids = list(range(200, 223))
    eng.add_request(0, ids, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    got = []
    while eng.has_unfinished():
        for o in eng.step():
            got += o.new_token_ids
    x = torch.tensor([ids])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = ref.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=12, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    assert got == out[0, len(ids):].tolist()


def test_missing_and_foreign_paths_are_refused(tmp_path):
    """A missing path, an empty directory and an unsupported model_type raise ModelLoadError."""
    with pytest.raises(ModelLoadError, match="is not a .gguf file or a directory"):
        load_checkpoint(tmp_path / "nope")
    with pytest.raises(ModelLoadError, match="neither config.json nor a .gguf"):
        load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ModelLoadError, match="'gpt2' is not supported"):
        load_checkpoint(tmp_path)


def test_an_upper_case_gguf_suffix_is_read_as_gguf(tmp_path):
    """MODEL.GGUF is read by the GGUF reader, as the commands' --model check accepts it (it was refused as "not
    a .gguf file" after the check had passed it); a file that is not GGUF inside says so."""
    bad = tmp_path / "model.GGUF"
    bad.write_bytes(b"not a gguf file")
    with pytest.raises(ModelLoadError, match=r"model\.GGUF is not a readable GGUF file"):
        load_checkpoint(bad)


def test_prepacked_bf16_weights_give_plain_results_bit_for_bit(tiny_dir, monkeypatch):
    """In bfloat16 on a CPU the weights are pre-packed for oneDNN at load, and a chunked prefill then a
    decode give exactly the logits of the same model with plain weights."""
    dtype = torch.bfloat16
    from stallfree.engine import model as model_mod

    if not model_mod.prepacking_applies(dtype, torch.device("cpu")):
        pytest.skip("this torch cannot pre-pack bfloat16 weights on this CPU")
    path, _ = tiny_dir
    ck = load_checkpoint(path)
    packed = model_mod.LlamaModel(ck.config, ck.tensors, dtype=dtype)
    monkeypatch.setattr(model_mod, "prepacking_applies", lambda *_: False)
    plain = model_mod.LlamaModel(ck.config, ck.tensors, dtype=dtype)
    assert packed.prepacked and not plain.prepacked
    ids = list(range(300, 330))
    steps = [[BatchEntry(ids[:20], 0, [0, 1], "last")], [BatchEntry(ids[20:], 20, [0, 1], "last")],
             [BatchEntry([7], 30, [0, 1], "last")]]
    logits = {}
    for name, m in (("packed", packed), ("plain", plain)):
        kv = KVCache(2, 2, 16, 4, 16, dtype, torch.device("cpu"))
        logits[name] = [m.forward(build_flat_batch(s, 16, torch.device("cpu")), kv) for s in steps]
    for a, b in zip(logits["packed"], logits["plain"], strict=True):
        assert torch.equal(a, b)


def test_prepacking_only_where_it_changes_nothing(monkeypatch):
    """No packing in float32, float16 or on a GPU, nor where the packed matmul fails or differs from
    F.linear."""
    from stallfree.engine import model as model_mod

    cpu = torch.device("cpu")
    assert not model_mod.prepacking_applies(torch.float32, cpu)
    assert not model_mod.prepacking_applies(torch.float16, cpu)
    assert not model_mod.prepacking_applies(torch.bfloat16, torch.device("cuda"))

    def fails(w):
        raise RuntimeError("no oneDNN kernel for this CPU")

    monkeypatch.setattr(model_mod, "_prepack_linear", fails)
    assert not model_mod.prepacking_applies(torch.bfloat16, cpu)
    monkeypatch.undo()
    monkeypatch.setattr(model_mod, "_packed_linear", lambda x, w, b=None: torch.zeros(x.shape[0], w.shape[0],
                                                                                       dtype=x.dtype))
    assert not model_mod.prepacking_applies(torch.bfloat16, cpu)


def test_max_model_len_caps_the_context(tiny_dir):
    """from_pretrained(max_model_len=100) on a 256-token model: the engine's context is 100 tokens,
    a request over it is refused; above the model's 256 it is an InvalidConfig naming both."""
    from stallfree.core import InvalidConfig
    from stallfree.engine.errors import ContextLengthExceeded

    path, _ = tiny_dir
    eng = LLMEngine.from_pretrained(path, token_budget=32, max_seqs=2, kv_tokens=512, max_model_len=100)
    assert eng.info.max_model_len == 100 == eng.max_model_len
    with pytest.raises(ContextLengthExceeded, match="maximum context length is 100 tokens"):
        eng.add_request("r", list(range(5, 95)), SamplingParams(max_tokens=20))
    eng.add_request("ok", list(range(5, 85)), SamplingParams(max_tokens=20, temperature=0.0))
    while eng.has_unfinished():
        eng.step()
    with pytest.raises(InvalidConfig, match="max_model_len 257 is above the model's context length of 256"):
        LLMEngine.from_pretrained(path, max_model_len=257)
