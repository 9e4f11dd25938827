#!/usr/bin/env bash
# One lent GPU machine's checks, in one go (docs/benchmarks.md, "The CUDA paths"): the CUDA tests,
# the planner's two GPU figures, and bench on a 1B-parameter Llama shape (random weights, bf16)
# beside transformers on the same GPU. The machine has torch but not every dependency: pure-Python
# wheels (loguru, gguf) travel in .whl/. Results land in $OUT (or ./gpu-out).
#     bash benchmarks/gpu_session.sh
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONPATH=${PYTHONPATH:-$PWD}
step() { echo "=== $* ($(date -u +%T), $(uptime | sed 's/.*load/load/'))"; }

step machine
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
python3 -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name(), torch.cuda.device_count())"
nproc; uptime

step "tests/gpu"
timeout 240 python3 -m pytest -q -rs -s -p no:cacheprovider tests/gpu 2>&1 | tee "$OUT/gpu_tests.log" | tail -25

step "gpu_figures"
timeout 120 python3 -m dist_infer.bench.gpu_figures --json 2>"$OUT/gpu_figures.err" | tee "$OUT/gpu_figures.json"
tail -3 "$OUT/gpu_figures.err"

step "1B checkpoint"
CK=/tmp/llama-1b
timeout 120 python3 - "$CK" <<'EOF'
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
EOF

for batch in 1 8 32; do
    step "bench batch $batch"
    timeout 150 python3 -m dist_infer bench --model "$CK" --device cuda --dtype bfloat16 --batch $batch \
        --prompt-len 512 --gen-len 128 --repeat 3 --compare hf --json 2>"$OUT/bench_b$batch.err" \
        | tee "$OUT/bench_b$batch.json" | tail -c 1500
    tail -4 "$OUT/bench_b$batch.err"
done
step "bench batch 1, int8 weight-only (no peer)"
timeout 60 python3 -m dist_infer bench --model "$CK" --device cuda --dtype bfloat16 --quantization int8 --batch 1 \
    --prompt-len 512 --gen-len 64 --repeat 2 --json 2>"$OUT/bench_int8.err" | tail -c 600
tail -4 "$OUT/bench_int8.err"
step done
