"""`dist-infer bench-serve`: a load generator for any OpenAI-compatible completion server.

It sends streamed /v1/completions (or /v1/chat/completions) requests on an arrival schedule
(all at once, Poisson, gamma with a burstiness factor, or a trace's own timestamps), records
when every content chunk arrives, and reports TTFT, TPOT, ITL and E2E latency percentiles,
throughput and goodput under SLOs.

One module per job, each importing only those before it: `flags` (the command line, its argument
types and `InputError`), `arrivals` (when each request is sent), `prompts` (random prompt text and
ids), `datasets` (what is sent: synthetic, shared prefixes, ShareGPT or a CSV trace),
`conversations` and `multiturn` (multi-turn chats replayed turn by turn, each turn the whole
conversation so far), `client` (the HTTP side: streamed requests, TTFT and ITL capture, keys and
TLS), `cache_metrics` (the server's prefix cache hit rate over the run, from /metrics), `report`
(percentiles, goodput, the table, the PNG, JSON) and `command` (`run_bench_serve` and the standalone
`main`). The maths are pure functions so the tests check them without a server; only
`client.run_load` does I/O. Nothing is server-specific: the requests use the OpenAI fields (plus
`ignore_eos`, only when asked for), and the responses are read from the OpenAI streaming format,
with vLLM-style extras (`token_ids` in a choice, usage in every chunk) used when present.

This package imports none of its modules, so the CLI's parser (`dist_infer.cli.parser`) can take the
flags from `flags` on every command without loading numpy or httpx.
"""
