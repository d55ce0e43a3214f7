"""LoRA adapters in the engine (stallfree.engine.lora): PEFT folders checked against the base model, and
greedy tokens of a batch mixing two adapters and the base equal to transformers with each adapter merged."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from tests.engine.lora_helpers import make_adapter, merge_into, restore

from stallfree.engine.config import ModelConfig
from stallfree.engine.errors import InvalidLoraAdapter, UnknownLora
from stallfree.engine.lora import LoraManager, read_peft_adapter

TINY = ModelConfig(vocab_size=32, hidden_size=8, intermediate_size=12, num_layers=2, num_heads=2, num_kv_heads=1,
                   head_dim=4, rms_norm_eps=1e-5, rope_theta=10000.0, max_model_len=64, tie_embeddings=True)


def test_fused_weights_are_the_merged_delta(tmp_path) -> None:
    """The fused qkv pair's B A, times x, equals each module's s B A in its rows (s = alpha / r = 2)."""
    t = make_adapter(tmp_path / "a", TINY, ["q_proj", "v_proj"], rank=2, alpha=4, seed=1)
    ad = read_peft_adapter(tmp_path / "a", "a", 1, TINY, 16)
    assert (ad.rank, ad.scaling, ad.modules) == (2, 2.0, ("q_proj", "v_proj"))
    a, b = ad.layers[1]["qkv"]
    delta = b @ a  # [q + k + v rows, d]
    pre = "base_model.model.model.layers.1.self_attn."
    want_q = 2.0 * t[pre + "q_proj.lora_B.weight"] @ t[pre + "q_proj.lora_A.weight"]
    want_v = 2.0 * t[pre + "v_proj.lora_B.weight"] @ t[pre + "v_proj.lora_A.weight"]
    torch.testing.assert_close(delta[:8], want_q)
    assert delta[8:12].abs().max() == 0  # k is not targeted
    torch.testing.assert_close(delta[12:16], want_v)
    assert set(ad.layers[0]) == {"qkv"}


def test_rslora_scaling(tmp_path) -> None:
    """use_rslora scales by alpha / sqrt(r): 8 / sqrt(4) = 4."""
    make_adapter(tmp_path / "a", TINY, ["o_proj"], rank=4, alpha=8, seed=2, config_extra={"use_rslora": True})
    assert read_peft_adapter(tmp_path / "a", "a", 1, TINY, 16).scaling == 4.0


@pytest.mark.parametrize(("change", "match"), [
    ("no_config", "has no adapter_config.json"),
    ("no_weights", "has no adapter_model.safetensors"),
    ("rank", "rank r=4 is above --max-lora-rank 2"),
    ("target", "target module 'lm_head' does not match the base model"),
    ("shape", r"is \[4, 9\], the base model needs \[4, 8\]"),
    ("dora", "use_dora=True is not supported"),
], ids=["no-config", "no-weights", "rank", "target", "shape", "dora"])
def test_bad_adapters_are_named(tmp_path, change: str, match: str) -> None:
    """Each bad folder is one InvalidLoraAdapter naming the adapter and what does not match."""
    folder = tmp_path / "a"
    cfg = TINY
    if change == "shape":
        from dataclasses import replace

        cfg = replace(TINY, hidden_size=9)
    make_adapter(folder, cfg, ["q_proj"], rank=4, alpha=4, seed=3)
    meta = json.loads((folder / "adapter_config.json").read_text())
    if change == "no_config":
        (folder / "adapter_config.json").unlink()
    elif change == "no_weights":
        (folder / "adapter_model.safetensors").unlink()
    elif change == "target":
        meta["target_modules"] = ["q_proj", "lm_head"]
    elif change == "dora":
        meta["use_dora"] = True
    if change in ("target", "dora"):
        (folder / "adapter_config.json").write_text(json.dumps(meta))
    with pytest.raises(InvalidLoraAdapter, match=match):
        read_peft_adapter(folder, "a", 1, TINY, 2 if change == "rank" else 16)


def test_manager_names_and_unload_with_users(tmp_path) -> None:
    """A name served twice is refused; an unloaded adapter is unknown to new requests at once and its
    weights are held until its last request ends."""
    make_adapter(tmp_path / "a", TINY, ["q_proj"], rank=2, alpha=2, seed=4)
    mgr = LoraManager(TINY, 2, 16, torch.device("cpu"), torch.float32)
    mgr.add(mgr.read("sql", tmp_path / "a"))
    with pytest.raises(InvalidLoraAdapter, match="'sql' is already served"):
        mgr.read("sql", tmp_path / "a")
    lid = mgr.id_of("sql")
    mgr.acquire(lid)
    mgr.remove("sql")
    with pytest.raises(UnknownLora, match="served adapters: none"):
        mgr.id_of("sql")
    assert mgr.num_held == 1
    step = mgr.step([(None, 2), (lid, 3)], torch.device("cpu"))
    assert step is not None and step.groups[0][0].tolist() == [2, 3, 4]
    mgr.release(lid)
    assert mgr.num_held == 0 and mgr.num_resident == 0
    with pytest.raises(InvalidLoraAdapter, match="'sql' is not served"):
        mgr.remove("sql")


def test_device_copies_follow_max_loras(tmp_path) -> None:
    """With max_loras 1, switching between two adapters step by step loads each again (LRU of one)."""
    mgr = LoraManager(TINY, 1, 16, torch.device("cpu"), torch.float32)
    for i, name in enumerate(("a", "b")):
        make_adapter(tmp_path / name, TINY, ["o_proj"], rank=2, alpha=2, seed=10 + i)
        mgr.add(mgr.read(name, tmp_path / name))
    ids = [mgr.id_of("a"), mgr.id_of("b")]
    for lid in ids + ids + [ids[1]]:
        mgr.step([(lid, 1)], torch.device("cpu"))
    assert mgr.num_loads == {"a": 2, "b": 2} and mgr.num_resident == 1


# ---------------------------------------------------------------------------------------------- the real model

MODS_1 = ["q_proj", "k_proj", "v_proj", "o_proj"]
MODS_2 = ["gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, checkpoint):
    """Two random adapters for the bundled model: attention (r 8, alpha 16) and MLP (r 4, alpha 16)."""
    root = tmp_path_factory.mktemp("loras")
    cfg = checkpoint.config
    return {
        "attn": (root / "attn", make_adapter(root / "attn", cfg, MODS_1, 8, 16, seed=11, b_std=0.15), 2.0),
        "mlp": (root / "mlp", make_adapter(root / "mlp", cfg, MODS_2, 4, 16, seed=12, b_std=0.3), 4.0),
    }


@pytest.mark.slow
def test_two_adapters_and_base_in_one_batch_equal_merged_reference(model, checkpoint, adapters, hf_model,
                                                                    run_to_end):
    """Must show: greedy tokens of base, adapter 1 and adapter 2 requests sharing every step (chunked
    prefills beside decodes) equal transformers' greedy generate with each adapter merged by hand,
    W + (alpha/r) B A, and each adapter's tokens differ from the base model's."""
    from stallfree.engine import LLMEngine, SamplingParams, engine_config

    prompts = ["The capital of France is", "def fib(n):"]
    new = 8
    eng = LLMEngine(model, checkpoint.tokenizer, scheduler=engine_config(7, 8, 2048, max_loras=2),
                    enable_lora=True, lora_modules={n: p for n, (p, _, _) in adapters.items()})
    greedy = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    for lora in (None, "attn", "mlp"):
        for j, p in enumerate(prompts):
            eng.add_request((lora, j), p, greedy, lora=lora)
    mixed = 0
    got: dict[tuple, list[int]] = {}
    while eng.has_unfinished():
        for o in eng.step():
            got.setdefault(o.rid, []).extend(o.new_token_ids)
        in_step = {eng._seqs[c.rid].lora if c.rid in eng._seqs else None for c in eng.last_plan}
        mixed = max(mixed, len(in_step))
    assert mixed == 3  # base and both adapters in one step
    m, _ = hf_model
    for lora in (None, "attn", "mlp"):
        saved = {} if lora is None else merge_into(m, adapters[lora][1], adapters[lora][2])
        try:
            for j, p in enumerate(prompts):
                x = torch.tensor([checkpoint.tokenizer.encode(p)])
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    out = m.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, do_sample=False,
                                     eos_token_id=None, pad_token_id=2)
                want = out[0, x.shape[1]:].tolist()
                print("lora", lora, "prompt", j, "engine", got[(lora, j)], "reference", want)
                assert got[(lora, j)] == want, (lora, p)
        finally:
            restore(m, saved)
    for j in range(len(prompts)):
        assert got[("attn", j)] != got[(None, j)] and got[("mlp", j)] != got[(None, j)]
    assert eng.lora.num_held == 2 and eng.scheduler.stats().num_running == 0


@pytest.mark.slow
def test_max_loras_bounds_each_step_and_unknown_is_refused(model, checkpoint, adapters, run_to_end):
    """With max_loras 1, no step holds two adapters and every request finishes, those of an adapter unloaded
    after the first step included (its weights are dropped when they end); an unknown adapter is UnknownLora
    naming the served ones, and nothing is queued."""
    from stallfree.engine import LLMEngine, SamplingParams, engine_config

    eng = LLMEngine(model, checkpoint.tokenizer, scheduler=engine_config(16, 8, 2048, max_loras=1),
                    enable_lora=True, lora_modules={n: p for n, (p, _, _) in adapters.items()})
    with pytest.raises(UnknownLora, match="served adapters: 'attn', 'mlp'"):
        eng.add_request("x", "Hi", SamplingParams(max_tokens=2), lora="nope")
    assert not eng.has_unfinished()
    for i in range(6):
        eng.add_request(i, "Hello there", SamplingParams(max_tokens=3, temperature=0),
                        lora=(None, "attn", "mlp")[i % 3])
    seen = []
    tokens: dict[int, int] = {}
    while eng.has_unfinished():
        for o in eng.step():
            tokens[o.rid] = tokens.get(o.rid, 0) + len(o.new_token_ids)
        seen.append({eng._seqs[c.rid].lora for c in eng.last_plan if c.rid in eng._seqs} - {None})
        if len(seen) == 1:  # unloaded while its requests wait or run: they finish with it
            eng.unload_lora_adapter("attn")
            with pytest.raises(UnknownLora):
                eng.add_request("late", "Hi", SamplingParams(max_tokens=2), lora="attn")
    assert max(len(s) for s in seen) == 1
    assert tokens == {i: 3 for i in range(6)}
    assert {i.name: i.num_requests for i in eng.lora_adapters()} == {"mlp": 2}
    assert eng.lora.num_held == 1 and eng.lora.num_resident <= 1
