"""The peak memory of generation itself on this rank: the peak-RSS counter reset before it runs."""

from __future__ import annotations

from typing import Optional


def reset_peak_rss() -> bool:
    """Restart this process's peak-RSS counter (Linux: writing 5 to clear_refs resets VmHWM)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_since_reset_mb() -> float:
    """VmHWM in MiB: the peak resident memory since the last `reset_peak_rss`."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    raise OSError("no VmHWM in /proc/self/status")


def generation_memory(run) -> tuple[object, Optional[float], Optional[float]]:
    """Run `run()` and measure this rank's memory: (its result, peak RSS during it, peak above the RSS before it).

    The second number is what generation itself holds at its peak: KV cache plus activations
    (plus ring buffers with cp), the loaded weights excluded. None where /proc cannot tell.
    """
    from dist_infer.models.checkpoint import current_rss_mb

    before = current_rss_mb()
    if not reset_peak_rss():
        return run(), None, None
    result = run()
    peak = peak_rss_since_reset_mb()
    return result, peak, max(0.0, peak - before)
