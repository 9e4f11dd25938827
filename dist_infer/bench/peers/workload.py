"""The workload and its timing loop, shared by every peer: seeded prompts, one prefill, greedy decode steps."""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

PROMPT_SEED = 1234
MIN_TOKEN_ID = 3  # ids below this are often special (pad/bos/eos): prompts avoid them
WARMUP_PROMPT_LEN = 16
WARMUP_DECODE_STEPS = 2


def make_prompts(batch: int, prompt_len: int, vocab_size: int, seed: int = PROMPT_SEED):
    """B x P token ids in [MIN_TOKEN_ID, vocab), the same on every rank and in every peer."""
    import torch

    if vocab_size <= MIN_TOKEN_ID:
        raise ValueError(f"vocab_size {vocab_size} leaves no ids >= {MIN_TOKEN_ID}")
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(MIN_TOKEN_ID, vocab_size, (batch, prompt_len), generator=gen, dtype=torch.long)


class StaticDecode:
    """transformers at its fastest: a static KV cache and the decode step under torch.compile with
    CUDA graphs (mode reduce-overhead), as its docs and gpt-fast recommend. One cache for every run
    (reset between them): a new one would be new inputs to the compiled graph."""

    def __init__(self, model, max_cache_len: int):
        import torch
        from transformers import StaticCache

        self.cache = StaticCache(config=model.config, max_cache_len=max_cache_len)
        self.decode = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)


def _greedy(
    forward: Callable, config, input_ids, decode_steps: int, on_step=None, static: Optional[StaticDecode] = None
):
    """Prefill `input_ids`, then `decode_steps` greedy steps; returns (tokens B x (1+steps), times)."""
    import torch
    from transformers import DynamicCache

    if static is not None:
        return _greedy_static(forward, static, input_ids, decode_steps)

    def synced(t):  # a CUDA step is timed to its end, not to its launch
        if t.is_cuda:
            torch.cuda.synchronize(t.device)
        return t

    cache = DynamicCache(config=config)
    t0 = time.perf_counter()
    out = forward(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    nxt = synced(out.logits[:, -1, :].argmax(dim=-1))
    times = [time.perf_counter() - t0]
    tokens = [nxt]
    for _ in range(decode_steps):
        t0 = time.perf_counter()
        out = forward(input_ids=nxt[:, None], past_key_values=cache, use_cache=True, logits_to_keep=1)
        nxt = synced(out.logits[:, -1, :].argmax(dim=-1))
        times.append(time.perf_counter() - t0)
        tokens.append(nxt)
    expected = input_ids.shape[1] + decode_steps
    if cache.get_seq_length() != expected:
        raise RuntimeError(f"KV cache holds {cache.get_seq_length()} positions after the loop, expected {expected}")
    return torch.stack(tokens, dim=1), times


def _greedy_static(forward: Callable, static: StaticDecode, input_ids, decode_steps: int):
    """`_greedy` through the static cache: the prefill eager, each decode step the compiled one."""
    import torch

    static.cache.reset()
    length = input_ids.shape[1]
    device = input_ids.device
    t0 = time.perf_counter()
    out = forward(
        input_ids=input_ids,
        past_key_values=static.cache,
        use_cache=True,
        cache_position=torch.arange(length, device=device),
        logits_to_keep=1,
    )
    nxt = out.logits[:, -1, :].argmax(dim=-1)
    torch.cuda.synchronize() if nxt.is_cuda else None
    times, tokens = [time.perf_counter() - t0], [nxt]
    for step in range(decode_steps):
        t0 = time.perf_counter()
        out = static.decode(
            input_ids=nxt[:, None],
            past_key_values=static.cache,
            use_cache=True,
            cache_position=torch.tensor([length + step], device=device),
            logits_to_keep=1,
        )
        nxt = out.logits[:, -1, :].argmax(dim=-1)
        torch.cuda.synchronize() if nxt.is_cuda else None
        times.append(time.perf_counter() - t0)
        tokens.append(nxt)
    return torch.stack(tokens, dim=1), times


def time_greedy(
    forward: Callable,
    config,
    batch: int,
    prompt_len: int,
    gen_len: int,
    barrier: Optional[Callable[[], None]] = None,
    repeats: int = 1,
    device: Optional[str] = None,
    static: Optional[StaticDecode] = None,
) -> dict[str, Any]:
    """The timed workload, identical for every peer. `forward` is the model (or engine) call.

    With `repeats` > 1 the timed run is repeated and the best (smallest) ttft and mean step time are
    kept: on a shared machine the minimum is the estimate least disturbed by other work.
    """
    import torch

    if batch < 1 or prompt_len < 1 or gen_len < 1 or repeats < 1:
        raise ValueError("batch, prompt_len, gen_len and repeats must be >= 1")
    vocab = config.get_text_config(decoder=True).vocab_size if hasattr(config, "get_text_config") else config.vocab_size
    prompts = make_prompts(batch, prompt_len, vocab)  # drawn on the CPU: the same ids on every device
    if device is not None:
        prompts = prompts.to(device)
    ttfts: list[float] = []
    tpots: list[float] = []
    tokens: Any = None  # the first run's greedy tokens (repeats >= 1: set in the loop)
    changed = 0
    with torch.inference_mode():
        # Untimed warm-up: allocator, thread pool, first-call paths, the process group's first collectives.
        # A compiled peer compiles and records its graphs here: a few more steps.
        _greedy(
            forward,
            config,
            prompts[:, : min(prompt_len, WARMUP_PROMPT_LEN)],
            WARMUP_DECODE_STEPS + (3 if static is not None else 0),
            static=static,
        )
        for _ in range(repeats):
            if barrier is not None:
                barrier()
            run_tokens, times = _greedy(forward, config, prompts, gen_len - 1, static=static)
            if tokens is None:
                tokens = run_tokens
            elif not torch.equal(tokens, run_tokens):
                if not tokens.is_cuda:  # the CPU kernels are deterministic: a change is a bug
                    raise RuntimeError("greedy tokens changed between repeats of the same workload")
                changed += int((tokens != run_tokens).sum())  # GPU reductions are not (near ties flip)
            ttfts.append(times[0])
            if len(times) > 1:
                tpots.append(sum(times[1:]) / (len(times) - 1))
    ttft = min(ttfts)
    tpot = min(tpots) if tpots else None
    return {
        "ttft_s": ttft,
        "prefill_tok_s": batch * prompt_len / ttft,
        "tpot_s": tpot,
        "decode_tok_s": (batch / tpot) if tpot else None,
        "token_ids": tokens.cpu().tolist(),
        "repeats": repeats,
        "ttft_s_all": ttfts,
        "tpot_s_all": tpots,
        "tokens_changed_between_repeats": changed,
    }
