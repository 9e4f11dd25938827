#!/usr/bin/env bash
# The CPU side of a lent machine (16 cores): the decode stack and tp=2 / the ladder with cores to
# spare, which this project's 2-core VM cannot show (docs/benchmarks.md, "Weights that stay quantized" and "Ladder Residual"). A random
# checkpoint in the default model's shape (SmolLM2-135M: hidden 576, 30 layers, 9 / 3 heads), int4
# weights quantized at load (groups of 32 with zeros, as its Q4_1 blocks). Results in $OUT.
# PARTS picks what runs: bench (the decode figures), mixed (prompt chunks beside decodes,
# benchmarks/mixed_steps.py at 2 and 16 threads); both by default.
#     [ROUNDS=2] [PARTS="bench mixed"] bash benchmarks/cpu_on_device.sh
set -u
OUT=${OUT:-cpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1 && [ ! -d /tmp/site ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site:$PWD
export PYTHONPATH=${PYTHONPATH:-$PWD}
step() { echo "=== $* ($(date -u +%T), $(uptime | sed 's/.*load/load/'))"; }

step "CPU: compiler and kernels"
nproc; lscpu | grep -i "model name"; which cc gcc
python3 -c "from dist_infer.kernels import load_cpu_kernels; print('native kernels:', load_cpu_kernels())"

CK=/tmp/smollm2-shape
timeout 120 python3 - "$CK" <<'PY'
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                  num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                  tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=100000.0)
LlamaForCausalLM(cfg).save_pretrained(sys.argv[1])
PY

bench() {  # name, OMP threads per rank, then bench's flags
    local name=$1 threads=$2; shift 2
    OMP_NUM_THREADS=$threads timeout 120 python3 -m dist_infer bench --model "$CK" --device cpu --quantization int4 \
        --batch 1 --prompt-len 128 --gen-len 32 --repeat 3 --json "$@" 2>"$OUT/$name.err" | tail -1 > "$OUT/$name.json"
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2], 'decode', round(d['decode_tok_s'],1), 'prefill', round(d['prefill_tok_s'],1))" "$OUT/$name.json" "$name" || tail -3 "$OUT/$name.err"
}
PARTS=${PARTS:-bench mixed}
case " $PARTS " in *" mixed "*)
    for t in 2 16; do
        step "mixed steps, $t threads"
        timeout 200 python3 benchmarks/mixed_steps.py --model "$CK" --quantization int4 --rounds 1 --threads $t \
            --json "$OUT/mixed_steps_t$t.json" 2>"$OUT/mixed_steps_t$t.err" | grep "^|" || tail -3 "$OUT/mixed_steps_t$t.err"
    done;;
esac
case " $PARTS " in *" bench "*) ;; *) ROUNDS=0;; esac
for r in $(seq 1 "${ROUNDS:-2}"); do
    step "round $r"
    bench tp1_r$r 2
    bench tp1_layers_r$r 2 --native-kernels layers
    bench tp2_r$r 1 --tp 2
    bench tp2_ladder_r$r 1 --tp 2 --ladder-residual all
    bench tp2_layers_r$r 1 --tp 2 --native-kernels layers
done
step done
