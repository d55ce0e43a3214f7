"""Dtypes and devices: the engine runs in bfloat16 and float16 as well as float32; float32 gives
transformers' greedy tokens (test_correctness) and is the default on CPUs without bf16 matrix units;
16-bit outputs are compared with float32 by their first divergence.
GPU tests are marked `gpu` and skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from stallfree.engine import LLMEngine, SamplingParams, engine_config
from stallfree.engine import engine as engine_mod
from stallfree.engine.engine import default_dtype
from stallfree.engine.model import LlamaModel

PARIS = "The capital of France is"
PROMPTS = [PARIS, "one, two, three,", "Write a haiku about the sea.", "def fib(n):"]
GREEDY = dict(temperature=0, ignore_eos=True)
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def generate(model, tokenizer, prompts, max_tokens, fill=None, **kw):
    """Greedy tokens of `prompts` run together (budget 16, so prompts are chunked)."""
    eng = LLMEngine(model, tokenizer, scheduler=engine_config(16, len(prompts), 1024, **kw))
    if fill is not None:
        eng.kv.k[:, : eng.kv.num_slots] = fill
        eng.kv.v[:, : eng.kv.num_slots] = fill
    for i, p in enumerate(prompts):
        eng.add_request(i, p, SamplingParams(max_tokens=max_tokens, **GREEDY))
    got: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    while eng.has_unfinished():
        for o in eng.step():
            got[o.rid] += o.new_token_ids
    return [got[i] for i in range(len(prompts))]


def first_divergence(a, b):
    """The first index where a and b differ, or None."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


@pytest.mark.parametrize("bf16_units", [True, False], ids=["amx", "no_amx"])
def test_default_dtype_per_device(monkeypatch, bf16_units):
    """bfloat16 on a GPU whatever the CPU; on a CPU, bfloat16 only where it has bf16 matrix units."""
    monkeypatch.setattr(engine_mod, "cpu_has_bf16_matrix_units", lambda: bf16_units)
    assert default_dtype(torch.device("cuda")) is torch.bfloat16
    assert default_dtype(torch.device("cpu")) is (torch.bfloat16 if bf16_units else torch.float32)


def test_bf16_units_check_answers_false_where_torch_cannot_tell(monkeypatch):
    """A torch without the private CPU feature checks (older or other builds) gives False, not an error."""
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported", raising=False)
    assert engine_mod.cpu_has_bf16_matrix_units() is False


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_16bit_on_cpu_starts_like_float32(checkpoint, model, dtype):
    """In 16-bit on a CPU the France prompt still answers " Paris." (the first two tokens of
    float32's greedy output), and the KV cache is kept in that dtype."""
    m16 = LlamaModel(checkpoint.config, checkpoint.tensors, dtype=dtype)
    (got,) = generate(m16, checkpoint.tokenizer, [PARIS], 2)
    (want,) = generate(model, checkpoint.tokenizer, [PARIS], 2)
    assert got == want == [7042, 30]


@pytest.mark.gpu
@CUDA
def test_gpu_float32_equals_cpu(checkpoint, model):
    """On CUDA in float32, four chunked, batched requests give the CPU's greedy tokens (up to a
    float32 tie; the first divergence, if any, must come after 4 tokens)."""
    gpu = LlamaModel(checkpoint.config, checkpoint.tensors, dtype=torch.float32, device="cuda")
    got = generate(gpu, checkpoint.tokenizer, PROMPTS, 8)
    want = generate(model, checkpoint.tokenizer, PROMPTS, 8)
    for g, w in zip(got, want, strict=True):
        d = first_divergence(g, w)
        assert d is None or d >= 4, (g, w)


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("fill", [float("nan"), 6e4], ids=["nan", "huge"])
def test_gpu_unwritten_slots_never_reach_an_output(checkpoint, dtype, fill):
    """On CUDA, a cache whose unwritten slots hold NaN or a huge value gives exactly the tokens of
    a zero-filled one, in every dtype."""
    gpu = LlamaModel(checkpoint.config, checkpoint.tensors, dtype=dtype, device="cuda")
    want = generate(gpu, checkpoint.tokenizer, PROMPTS, 8, fill=0.0)
    assert generate(gpu, checkpoint.tokenizer, PROMPTS, 8, fill=fill) == want
