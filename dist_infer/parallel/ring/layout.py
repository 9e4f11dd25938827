"""Which rows every cp rank holds, and the block plan of each ring step derived from it.

`RingLayout` is what the ring loops and the cp metadata share: every rank's query and key
runs (built from position maps, the zigzag split, or gathered from the ranks), and from them
the blocks a rank computes at each step of either ring variant.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from dist_infer.comm.base import Communicator
from dist_infer.parallel.ring.blocks import Block, plan_blocks
from dist_infer.parallel.ring.errors import RingAttentionError
from dist_infer.parallel.ring.shards import Run, runs_from_positions, zigzag_chunks
from dist_infer.parallel.ring.variant import VARIANTS


@dataclass(frozen=True)
class RingLayout:
    """Which rows every cp rank holds: its queries and its keys/values, as runs of positions.

    Each rank's tensors are [q_rows[r], heads, d] and [k_rows[r], kv_heads, d]; the counts may
    differ between ranks (the ring pads its transfer buffers to the largest).
    """

    q_runs: tuple[tuple[Run, ...], ...]
    k_runs: tuple[tuple[Run, ...], ...]
    q_rows: tuple[int, ...]
    k_rows: tuple[int, ...]

    @property
    def cp(self) -> int:
        return len(self.q_runs)

    @classmethod
    def from_positions(
        cls,
        q_positions: Sequence[Sequence[int]],
        k_positions: Sequence[Sequence[int]],
        q_seqs: Optional[Sequence[Sequence[int]]] = None,
        k_seqs: Optional[Sequence[Sequence[int]]] = None,
    ) -> "RingLayout":
        """From every rank's row -> position maps (and row -> sequence maps for a batch)."""
        if len(q_positions) != len(k_positions):
            raise RingAttentionError(
                f"{len(q_positions)} ranks of query positions but {len(k_positions)} of key positions"
            )

        def runs(positions, seqs):
            positions = [int(p) for p in positions]
            seqs = [0] * len(positions) if seqs is None else [int(s) for s in seqs]
            out, start = [], 0
            for end in range(1, len(positions) + 1):
                if end == len(positions) or seqs[end] != seqs[start]:
                    out.extend(runs_from_positions(positions[start:end], seqs[start], start))
                    start = end
            return tuple(out)

        q_runs = tuple(runs(p, None if q_seqs is None else q_seqs[r]) for r, p in enumerate(q_positions))
        k_runs = tuple(runs(p, None if k_seqs is None else k_seqs[r]) for r, p in enumerate(k_positions))
        return cls(q_runs, k_runs, tuple(len(p) for p in q_positions), tuple(len(p) for p in k_positions))

    @classmethod
    def zigzag(cls, seq_lens: Sequence[int], cp: int) -> "RingLayout":
        """A batch of fresh sequences, each split zigzag; a rank's rows are its shards in batch order."""
        per_rank, rows = [], []
        for r in range(cp):
            runs, row = [], 0
            for seq, n in enumerate(seq_lens):
                shard = zigzag_chunks(n, cp, r)
                runs.extend(shard.runs(seq, row))
                row += shard.num_rows
            per_rank.append(tuple(runs))
            rows.append(row)
        return cls(tuple(per_rank), tuple(per_rank), tuple(rows), tuple(rows))

    @classmethod
    def gather(
        cls,
        group: Communicator,
        q_positions: torch.Tensor,
        k_positions: torch.Tensor,
        q_seqs: Optional[torch.Tensor] = None,
        k_seqs: Optional[torch.Tensor] = None,
    ) -> "RingLayout":
        """Collective: every rank passes only its own maps; one all-gather of counts, one of maps."""
        maps = [
            q_positions,
            k_positions,
            torch.zeros_like(q_positions) if q_seqs is None else q_seqs,
            torch.zeros_like(k_positions) if k_seqs is None else k_seqs,
        ]
        counts = torch.tensor([q_positions.numel(), k_positions.numel()], dtype=torch.long)
        all_counts = torch.empty(group.size, 2, dtype=torch.long)
        group.all_gather(all_counts, counts)
        width = max(1, int(all_counts.max()))
        mine = torch.full((4, width), -1, dtype=torch.long)
        for i, m in enumerate(maps):
            mine[i, : m.numel()] = m.reshape(-1).to(torch.long).cpu()
        everyone = torch.empty(group.size, 4, width, dtype=torch.long)
        group.all_gather(everyone, mine)
        qn, kn = all_counts[:, 0].tolist(), all_counts[:, 1].tolist()
        rows = everyone.tolist()
        return cls.from_positions(
            [rows[r][0][: qn[r]] for r in range(group.size)],
            [rows[r][1][: kn[r]] for r in range(group.size)],
            [rows[r][2][: qn[r]] for r in range(group.size)],
            [rows[r][3][: kn[r]] for r in range(group.size)],
        )

    def steps(self, rank: int, variant: str, causal: bool = True) -> list[list[Block]]:
        """The blocks `rank` computes at each ring step.

        pass-KV: at step i the rank holds rank (rank - i)'s keys and attends its own queries.
        pass-Q: at step i it holds rank (rank - i)'s queries and attends them to its own keys.
        """
        if variant not in VARIANTS:
            raise RingAttentionError(f"ring variant {variant!r} is not one of {VARIANTS}")
        n = self.cp
        out = []
        for i in range(n):
            src = (rank - i) % n
            if variant == "pass-kv":
                out.append(plan_blocks(self.q_runs[rank], self.k_runs[src], causal))
            else:
                out.append(plan_blocks(self.q_runs[src], self.k_runs[rank], causal))
        return out
