#!/usr/bin/env bash
# One prepared GPU check of the worker hot path, for a lent H200 (or any CUDA GPU); at most ~8 minutes.
# Reaches no package registry and downloads nothing: run it from the repository root with the
# project's venv active (torch with CUDA, triton). Writes logs to ${OUT:-gpu-check}/.
#   1. kernels against the PyTorch oracle on CUDA (bf16/fp16/fp32), copy_blocks aliasing, staging (~1 min)
#   2. step anatomy on Llama-3.1-8B shapes, dummy weights: wall, host, GPU busy; eager and graphs (~2 min)
#   3. ops/bench_kernels.py --quick                                                          (~1 min)
#   4. pagedkv serve (dummy Llama-3.1-8B) at 1/16/64/256 concurrent streams                  (~3 min)
set -uo pipefail
OUT=${OUT:-gpu-check}
mkdir -p "$OUT"
CFG=${MODEL_CONFIG:-../shared/model-configs/llama-3.1-8b}
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
status=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"

echo "== 1. kernels vs oracle"
timeout 75 python ops/gpu_check.py kernels 2>&1 | tee "$OUT/kernels.log" || status=1

echo "== 2. step anatomy (Llama-3.1-8B shapes, dummy weights, bf16)"
timeout 120 python ops/gpu_check.py anatomy --model-config "$CFG" 2>&1 | tee "$OUT/anatomy.log" || status=1

echo "== 3. kernel benchmark"
timeout 75 python ops/bench_kernels.py --quick --iters 10 2>&1 | tee "$OUT/bench_kernels.log" || status=1

echo "== 4. served dummy Llama-3.1-8B, concurrent streams"
PORT=18123
MODEL="$OUT/llama-3.1-8b-dummy"
python - "$OUT/trace.csv" "$CFG" "$MODEL" <<'PY'
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
timeout 240 pagedkv serve --model "$MODEL" --load-format dummy --max-model-len 4096 --port $PORT \
    --log-level warning > "$OUT/serve.log" 2>&1 &
SERVER=$!
for _ in $(seq 1 100); do curl -sf "http://127.0.0.1:$PORT/v1/models" > /dev/null && break; sleep 1; done
for N in 1 16 64 256; do
  timeout 30 pagedkv bench --url "http://127.0.0.1:$PORT" --model "$MODEL" --trace "$OUT/trace.csv" \
      --num-requests $N --request-rate inf --token-scale 1 --no-plots --no-progress \
      --output-dir "$OUT" --name "serve-$N" > /dev/null 2>&1 || status=1
  python -c "import json,sys; r=json.load(open('$OUT/serve-$N.json'))['runs']['server']; \
print(f'streams $N: {r[\"output_token_throughput\"]:.0f} output tok/s, ITL p50 {1000*r[\"itl_s\"][\"p50\"]:.1f} ms, errors {r[\"num_errors\"]}')" \
      | tee -a "$OUT/serve.txt" || status=1
done
kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null
echo "gpu_check: $([ $status = 0 ] && echo OK || echo FAILED) (logs in $OUT/)"
exit $status
