#!/usr/bin/env bash
# One prepared GPU check of the worker hot path, for a lent H200 (or any CUDA GPU); ends within
# $GPU_CHECK_BUDGET_S seconds (570: inside a 10-minute call, whatever a step does).
#   1. kernels against the PyTorch oracle on CUDA (bf16/fp16/fp32), copy_blocks aliasing, staging, decode
#      graphs against eager steps, the device block table, the memory profile against a prompt-logprobs step
#   2. step anatomy on Llama-3.1-8B shapes, dummy weights: wall, host, GPU busy; eager and graphs
#   3. ops/bench_kernels.py --quick
#   4. pagedkv serve (dummy Llama-3.1-8B) at 1/16/64/256 concurrent streams
# Each step's first run compiles its Triton kernels (about a second each, dozens in step 1).
#
# Reaches no package registry and installs nothing system-wide. Needs python3 with torch (CUDA) and
# triton; `pagedkv` is imported from this tree (a link on PYTHONPATH, nothing installed). Python packages
# a plain torch image lacks (msgspec, pyzmq, structlog) are installed from the wheels in $WHEELS (default
# .whl/ at the repository root) into a temporary folder when it holds any; fetch them beforehand where a
# package index is reachable, for the GPU machine's Python (default 3.12):
#   bash ops/gpu_check.sh --fetch-wheels        # writes .whl/ (git-ignored: carry it to the GPU machine)
# Model config: $MODEL_CONFIG, else shared/model-configs/llama-3.1-8b in or beside the repository, else a
# copy of Llama-3.1-8B's config.json written here. Six logs go to ${OUT:-gpu-check}/ (a lent machine sends back
# 8 files at most), scratch files to a temporary folder. Steps: $GPU_CHECK_STEPS (default "1 2 3 4").
# Exit status 0 when every step ran and passed.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-$(command -v python3 || command -v python)}
WHEELS=${WHEELS:-.whl}
NEEDED_WHEELS="msgspec pyzmq structlog"  # the engine's imports a torch image lacks (aiohttp, uvloop, ... it has)

if [ "${1:-}" = "--fetch-wheels" ]; then
  mkdir -p "$WHEELS"
  exec "$PY" -m pip download --no-deps --only-binary=:all: --python-version "${WHEEL_PYTHON:-3.12}" \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
      -d "$WHEELS" $NEEDED_WHEELS
fi

OUT=${OUT:-gpu-check}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
DEADLINE=$((SECONDS + ${GPU_CHECK_BUDGET_S:-570}))
STEPS=" ${GPU_CHECK_STEPS:-1 2 3 4} "
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
status=0

# `import pagedkv` from this tree; carried wheels beside it; scratch files (trace, dummy model, bench results)
PKG=$(mktemp -d)
SCRATCH="$PKG/scratch"
mkdir -p "$SCRATCH"
ln -s "$PWD" "$PKG/pagedkv"
export PYTHONPATH="$PKG${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G "$WHEELS/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$PKG/site" "$WHEELS"/*.whl \
    && export PYTHONPATH="$PKG/site:$PYTHONPATH" || echo "installing $WHEELS/*.whl failed"
fi

# seconds a step may run: its own bound, cut to what is left before the deadline
bound() { local left=$((DEADLINE - SECONDS)); left=$(( left < 1 ? 1 : left )); echo $(( $1 < left ? $1 : left )); }  # never 0: timeout 0 waits forever
# modules a step imports that are missing here (empty: none)
missing() { "$PY" - "$@" <<'PY'
import importlib.util, sys
print(" ".join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))
PY
}
# whether to run step $1 ("N. title"): it is selected, its modules ($2) are there and time is left
step() {
  local n=${1%%.*} gone
  [[ $STEPS == *" $n "* ]] || return 1
  echo "== $1"
  gone=$(missing $2)
  if [ -n "$gone" ]; then
    echo "   SKIPPED: python module(s) missing: $gone (wheels for msgspec pyzmq structlog: bash ops/gpu_check.sh" \
         "--fetch-wheels where an index is reachable, then carry $WHEELS/)"
    status=1; return 1
  fi
  if [ "$(bound 30)" -lt 30 ]; then echo "   SKIPPED: under 30 s left of ${GPU_CHECK_BUDGET_S:-570}"; status=1; return 1; fi
  return 0
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$OUT/gpu.txt"

CFG=${MODEL_CONFIG:-}
for d in shared/model-configs/llama-3.1-8b ../shared/model-configs/llama-3.1-8b; do
  [ -z "$CFG" ] && [ -f "$d/config.json" ] && CFG=$(cd "$d" && pwd)
done
if [ -z "$CFG" ]; then  # the GPU machine gets the repository alone: shared/ beside it does not travel
  CFG="$SCRATCH/llama-3.1-8b-config"
  mkdir -p "$CFG"
  cat > "$CFG/config.json" <<'JSON'
{"architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
 "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu",
 "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072,
 "mlp_bias": false, "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
 "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
 "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192, "rope_type": "llama3"},
 "rope_theta": 500000.0, "tie_word_embeddings": false, "torch_dtype": "bfloat16", "use_cache": true,
 "vocab_size": 128256}
JSON
fi
echo "model config: $CFG"

WORKER="torch triton numpy msgspec safetensors"
if step "1. kernels vs oracle" "$WORKER"; then
  timeout "$(bound 150)" "$PY" ops/gpu_check.py kernels 2>&1 | tee "$OUT/kernels.log" || status=1
fi

if step "2. step anatomy (Llama-3.1-8B shapes, dummy weights, bf16)" "$WORKER"; then
  timeout "$(bound 150)" "$PY" ops/gpu_check.py anatomy --model-config "$CFG" 2>&1 | tee "$OUT/anatomy.log" || status=1
fi

if step "3. kernel benchmark" "torch triton"; then
  timeout "$(bound 90)" "$PY" ops/bench_kernels.py --quick --iters 10 2>&1 | tee "$OUT/bench_kernels.log" || status=1
fi

if step "4. served dummy Llama-3.1-8B, concurrent streams" "$WORKER zmq structlog aiohttp uvloop tokenizers jinja2 prometheus_client tqdm"; then
  PORT=${GPU_CHECK_PORT:-18123}
  : > "$OUT/serve.txt"
  MODEL="$SCRATCH/llama-3.1-8b-dummy"
  "$PY" - "$SCRATCH/trace.csv" "$CFG" "$MODEL" <<'PY'
import json, os, shutil, sys
from tokenizers import Tokenizer, models, pre_tokenizers
with open(sys.argv[1], "w") as f:  # 256 requests of 512 prompt + 128 output tokens, all at t=0
    f.write("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    f.writelines("2023-11-16 18:15:46.6805900,512,128\n" for _ in range(256))
os.makedirs(sys.argv[3], exist_ok=True)  # the config plus a word-level tokenizer covering the vocabulary
shutil.copy(os.path.join(sys.argv[2], "config.json"), sys.argv[3])
vocab = json.load(open(os.path.join(sys.argv[2], "config.json")))["vocab_size"]
tok = Tokenizer(models.WordLevel({f"<{i}>": i for i in range(vocab)}, unk_token="<0>"))
tok.pre_tokenizer = pre_tokenizers.Whitespace()
tok.save(os.path.join(sys.argv[3], "tokenizer.json"))
PY
  timeout "$(bound 240)" "$PY" -m pagedkv.scheduler.cli serve --model "$MODEL" --load-format dummy \
      --max-model-len 4096 --port "$PORT" --log-level warning > "$OUT/serve.log" 2>&1 &
  SERVER=$!
  # ready when /v1/models answers (no curl needed); gives up when the server exits or time runs out
  "$PY" - "$PORT" "$SERVER" "$(bound 150)" <<'PY' || status=1
import os, sys, time, urllib.request
port, pid, limit = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
start = time.monotonic()
while time.monotonic() - start < limit:
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2).read()
        print(f"server ready after {time.monotonic() - start:.0f} s")
        sys.exit(0)
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            sys.exit(print("server exited before it answered (see serve.log)") or 1)
        time.sleep(1)
sys.exit(print(f"server not ready after {limit:.0f} s (see serve.log)") or 1)
PY
  for N in 1 16 64 256; do
    timeout "$(bound 30)" "$PY" -m pagedkv.scheduler.cli bench --url "http://127.0.0.1:$PORT" --model "$MODEL" --load-format dummy \
        --trace "$SCRATCH/trace.csv" --num-requests $N --request-rate inf --token-scale 1 --no-plots --no-progress \
        --output-dir "$SCRATCH" --name "serve-$N" > "$SCRATCH/bench-$N.log" 2>&1 || { status=1; tail -5 "$SCRATCH/bench-$N.log"; }
    "$PY" -c "import json,sys; r=json.load(open(sys.argv[1]))['runs']['server']; \
print(f'streams $N: {r[\"output_token_throughput\"]:.0f} output tok/s, ITL p50 {1000*r[\"itl_s\"][\"p50\"]:.1f} ms, errors {r[\"num_errors\"]}')" \
        "$SCRATCH/serve-$N.json" 2>&1 | tee -a "$OUT/serve.txt" || status=1
  done
  kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null
fi
rm -rf "$PKG"
echo "gpu_check: $([ $status = 0 ] && echo OK || echo FAILED) after $SECONDS s (logs in $OUT/)"
exit $status
