#!/usr/bin/env bash
# A lent GPU machine's checks in one go, under 10 minutes (`make gpu-check`; docs/benchmarks.md, "The
# GPU decode step"): tests/gpu, then on a 1.1B Llama shape (random weights, bf16) the decode step with
# and without CUDA graphs beside its HBM floor (benchmarks/gpu_decode.py), and `dist-infer bench` beside
# transformers eager (and compiled with a static cache at batch 1) at batch 1 / 8 / 32. The machine has
# torch, Triton and transformers but no package index: the wheels it lacks (loguru, gguf; fastapi, uvicorn
# and pydantic for the serving step) travel in .whl/: `bash benchmarks/gpu_wheels.sh` here, then name .whl
# in the device call's carry.
# Results land in $OUT (or ./gpu-out), at most 8 files (what the device tool brings back). PY: the Python
# with torch (default python3). PROFILE=--profile: each graph's kernels by device time. DET=1: graphs
# against eager steps on the 1.1B shape under deterministic cuBLAS. FIGURES=1: the planner's GEMM and
# ring-step figures (dist_infer.bench.gpu_figures).
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
PY=${PY:-python3}
PROFILE=${PROFILE:-}
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONPATH=${PYTHONPATH:-$PWD}
step() { echo "=== $* ($(date -u +%T), $(uptime | sed 's/.*load/load/'))"; }

step machine
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
$PY -c "import torch, triton, transformers, sys; print(sys.version.split()[0], torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
nproc

step "tests/gpu"
timeout 300 $PY -m pytest -q -rs -p no:cacheprovider tests/gpu 2>&1 | tee "$OUT/gpu_tests.log" | tail -25

step "1B checkpoint"
CK=/tmp/llama-1b
timeout 120 $PY - "$CK" <<'PYEOF'
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                  num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096,
                  tie_word_embeddings=False)
with torch.device("cuda"):
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
model.save_pretrained(sys.argv[1])
print("params", sum(p.numel() for p in model.parameters()))
PYEOF

step "decode with and without CUDA graphs"
timeout 240 $PY benchmarks/gpu_decode.py --model "$CK" --batches 1,8,32 $PROFILE 2>/tmp/gpu_decode.err | tee "$OUT/gpu_decode.json"
tail -5 /tmp/gpu_decode.err
if [ "${DET:-0}" = 1 ]; then
    step "graphs against eager steps, deterministic cuBLAS"
    timeout 120 $PY benchmarks/gpu_decode.py --model "$CK" --batches 8,32 --gen-len 64 --deterministic 2>/tmp/gpu_decode_det.err \
        | tail -1 | tee "$OUT/gpu_decode_det.json" | tail -c 600
    tail -3 /tmp/gpu_decode_det.err
fi

for batch in 1 8 32; do
    peers=hf
    [ "$batch" = 1 ] && peers=hf,hf-compiled
    step "bench batch $batch (--compare $peers)"
    timeout 200 $PY -m dist_infer bench --model "$CK" --device cuda --dtype bfloat16 --batch $batch \
        --prompt-len 512 --gen-len 128 --repeat 2 --compare $peers --json 2>/tmp/bench_b$batch.err \
        | tee "$OUT/bench_b$batch.json" | tail -c 1200
    tail -4 /tmp/bench_b$batch.err
done
if $PY -c "import fastapi, uvicorn" 2>/dev/null; then  # the wheels of benchmarks/gpu_wheels.sh
    step "serve --device cuda under bench-serve (concurrency 1 and 16)"
    PORT=8321
    $PY -m dist_infer serve --model "$CK" --device cuda --dtype bfloat16 --port $PORT --max-num-seqs 32 \
        >/tmp/serve.log 2>&1 &
    SERVER=$!
    for _ in $(seq 120); do curl -sf http://127.0.0.1:$PORT/health >/dev/null && break; sleep 1; done
    for c in 1 16; do
        timeout 120 $PY -m dist_infer bench-serve --url http://127.0.0.1:$PORT --num-prompts $((c * 4 + 12)) \
            --max-concurrency $c --prompt-ids --input-len 512 --output-len 128 --seed $c --json 2>/tmp/bench_serve_c$c.err \
            | tail -1 | tee "$OUT/serve_c$c.json" | tail -c 700
        tail -2 /tmp/bench_serve_c$c.err
    done
    kill $SERVER; wait $SERVER 2>/dev/null
    grep -E "CUDA graphs|ERROR" /tmp/serve.log | tail -4
else
    echo "serving step skipped: no fastapi/uvicorn here (bash benchmarks/gpu_wheels.sh, then carry .whl)"
fi
if [ "${FIGURES:-0}" = 1 ]; then
    step "gpu_figures"
    timeout 120 $PY -m dist_infer.bench.gpu_figures --json 2>/tmp/gpu_figures.err | tee "$OUT/gpu_figures.json"
fi
step done
