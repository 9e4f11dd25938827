"""Peer runners for `dist-infer bench --compare`: the same greedy workload through other stacks.

One module each: `workload` (the prompts and the timed greedy loop), `metrics` (the result dict),
`runners` (hf, hf-tp, deepspeed, each inside its own processes), `cli` (the per-rank command line,
`python -m dist_infer.bench.peers`), `spawn` (starting a peer from the bench, one at a time) and
`llama_cpp` (llama.cpp's own llama-bench / llama-batched-bench on the same GGUF file: a C++ peer,
timed by its own programs, so none of the workload below applies to it; see that module).

Three Python peers, each run in its own process(es) so that none shares threads, memory or a process
group with another (or with us):

- ``hf``        HF transformers, one process, ``torch.set_num_threads(threads)``;
- ``hf-tp``     HF transformers' own tensor parallelism (``tp_plan="auto"``, DTensor over gloo),
                one rank per torchrun process;
- ``deepspeed`` DeepSpeed-Inference AutoTP (``init_inference(..., replace_with_kernel_inject=False)``)
                over gloo plus DeepSpeed's shared-memory all-reduce kernel, one rank per torchrun process.

The workload is identical for all three and timed by the same loop (`time_greedy`): B seeded
random prompts of exactly P token ids in [3, vocab); prefill = one forward over the B x P batch
(``ttft_s``, ``prefill_tok_s = B*P/ttft_s``); then G-1 greedy decode steps through a
``DynamicCache`` (``tpot_s`` = mean step time, ``decode_tok_s = B/tpot_s``). fp32, CPU (the
``hf`` peer alone runs where and in the dtype our run did: one GPU under ``bench --device cuda``),
``torch.inference_mode()``, one untimed warm-up (a short prefill and 2 decode steps) first;
``--repeats N`` times the workload N times and keeps the best ttft and mean step time (the estimate
least disturbed by other work on a shared machine).
The prefill asks the model for the last position's logits only (``logits_to_keep=1``), as a serving
engine would; every peer gets the same call.

Metrics (one dict per peer, written as JSON by rank 0)::

    {"peer", "prefill_tok_s", "decode_tok_s", "ttft_s", "tpot_s", "peak_rss_mb", "tp", "ok", "error",
     "token_ids" (B x G greedy ids), "peak_rss_mb_total", "load_s", "threads", "batch", "prompt_len",
     "gen_len", "world_size", "versions", "repeats", "ttft_s_all", "tpot_s_all",
     "tokens_changed_between_repeats" (0 on the CPU, where a change is an error; on a GPU, whose
     reductions are not deterministic, near ties may flip)}

`run_peer` adds "command", "wall_s", "loadavg_1m" (before, after) and, on failure, "stderr_tail".

Started by the bench through `run_peer` (one peer at a time, never concurrently), or by hand::

    python -m dist_infer.bench.peers --peer hf --model DIR --batch 4 --prompt-len 256 --gen-len 32 --json-out hf.json
    torchrun --nproc-per-node 2 -m dist_infer.bench.peers --peer deepspeed --model DIR ... --json-out ds.json

What the CPU setup needs (found by reading the installed sources):

- DeepSpeed under torchrun: `deepspeed.init_distributed` JIT-builds and loads its shared-memory
  all-reduce op (``deepspeed_shm_comm``), and `inference_all_reduce` then calls it for every
  row-parallel layer. The op only maps its shared-memory workspace when the env var ``LOCAL_SIZE``
  equals the world size, and DeepSpeed's own launcher sets ``LOCAL_SIZE`` but torchrun does not (it
  sets ``LOCAL_WORLD_SIZE``); the kernel then runs on unmapped buffers and every rank dies with
  SIGSEGV in its first forward. We set ``LOCAL_SIZE`` from ``LOCAL_WORLD_SIZE`` before
  `init_distributed`, which is what ``deepspeed``'s launcher would have done. The segments it leaves
  in /dev/shm (``deepspeed_allreduce_buffer_*_<port>_<rank>``) are removed by `run_peer`. With ranks
  on several hosts the op cannot map them at all, so there we force DeepSpeed's gloo fallback
  (``cdb.shm_vector_kernel_level = 0``, the flag `inference_all_reduce` checks). The first run on a
  machine JIT-compiles the op (minutes on a small machine; cached in ~/.cache/torch_extensions).
- transformers 5 deprecates ``from_pretrained(tp_plan=...)`` in favour of
  ``distributed_config=DistributedConfig(tp_plan="auto")``; we use the latter where it exists. HF TP
  picks its device from ``torch._C._get_accelerator()`` and the gloo backend for CPU, so it runs on
  CPU as is; `run_peer` hides any GPU (``CUDA_VISIBLE_DEVICES=""``, ``DS_ACCELERATOR=cpu``) so
  that all peers run the same fp32 CPU workload (all but ``hf`` asked for ``--device cuda``).
"""

from dist_infer.bench.peers.metrics import empty_metrics, failed
from dist_infer.bench.peers.runners import DISTRIBUTED_PEERS, PEERS, hf_from_pretrained
from dist_infer.bench.peers.spawn import peer_argv, run_peer
from dist_infer.bench.peers.workload import make_prompts, time_greedy

__all__ = [
    "DISTRIBUTED_PEERS",
    "PEERS",
    "empty_metrics",
    "failed",
    "hf_from_pretrained",
    "make_prompts",
    "peer_argv",
    "run_peer",
    "time_greedy",
]
