"""BlockMover's copies between real peer links in one process: a stage's blocks land where the
destination's layout keeps them, from a cache laid out as one pool (one gather / scatter op per
stage: kv_cache.stacked_layers) and from per-layer tensors of their own (an op per layer)."""

from __future__ import annotations

import time

import torch

from dist_infer.comm.peer.link import PeerLink
from dist_infer.engine.kv_cache import PagedKVCache
from dist_infer.engine.kv_transfer import BlockMover, KVLayout, PeerInstance, TransferOp

LAYERS, HEADS, KV_HEADS, BLOCKS, BLOCK, DIM = 3, 4, 2, 6, 4, 8


def pooled(kv_heads: int) -> list:
    return PagedKVCache(LAYERS, BLOCKS, BLOCK, kv_heads, DIM).layers


def separate(kv_heads: int) -> list:
    return [
        (torch.zeros(BLOCKS, BLOCK, kv_heads, DIM), torch.zeros(BLOCKS, BLOCK, kv_heads, DIM)) for _ in range(LAYERS)
    ]


def instance(index: int, tp: int, caches: list[list]) -> tuple[PeerInstance, list[BlockMover]]:
    links = [PeerLink(timeout=10) for _ in range(tp)]
    addresses = [link.address for link in links]
    layout = KVLayout(tp, 1, LAYERS, HEADS, KV_HEADS)
    movers = [BlockMover(link, layout, r, addresses, caches[r], range(LAYERS)) for r, link in enumerate(links)]
    return PeerInstance(index, tp, 1, tuple(addresses)), movers


def move(mid: int, src, src_blocks: list[int], dst, dst_blocks: list[int]) -> None:
    (src_peer, senders), (dst_peer, receivers) = src, dst
    for mover in receivers:
        mover.apply(TransferOp(TransferOp.RECV, mid, 0, src_peer, list(dst_blocks)))
    for mover in senders:
        mover.apply(TransferOp(TransferOp.SEND, mid, 0, dst_peer, list(src_blocks)))
    deadline = time.monotonic() + 30  # the drivers (rank 0) report a stage: a follower's receives tell its driver
    while not (receivers[0].stage_done(mid, 0) and senders[0].stage_done(mid, 0)):
        assert time.monotonic() < deadline, "the stage never completed"
        time.sleep(0.01)
    for mover in receivers:
        mover.apply(TransferOp(TransferOp.COMMIT, mid))
        assert mid not in mover.failures


def heads_of(caches: list[list], layer: int, kv: int, blocks: list[int]) -> torch.Tensor:
    """An instance's blocks of one layer's K or V with every KV head, its tp ranks' shares side by side."""
    return torch.cat([cache[layer][kv][blocks] for cache in caches], dim=2)


def test_blocks_move_between_pooled_and_per_layer_caches_across_tp_sizes():
    torch.manual_seed(0)
    src_caches = [pooled(KV_HEADS)]
    for k, v in src_caches[0]:
        k.copy_(torch.randn_like(k))
        v.copy_(torch.randn_like(v))
    mid_caches = [pooled(1), separate(1)]  # tp2: rank 0 one pool, rank 1 a tensor per layer
    back_caches = [separate(KV_HEADS)]
    src, mid, back = instance(0, 1, src_caches), instance(1, 2, mid_caches), instance(2, 1, back_caches)
    assert [m._stacked is not None for m in src[1] + mid[1] + back[1]] == [True, True, False, False], "both ways"
    move(11, src, [4, 1, 2], mid, [0, 5, 3])
    move(12, mid, [0, 5, 3], back, [2, 3, 4])
    for layer in range(LAYERS):
        for kv in (0, 1):
            want = heads_of(src_caches, layer, kv, [4, 1, 2])
            assert torch.equal(heads_of(mid_caches, layer, kv, [0, 5, 3]), want)
            assert torch.equal(heads_of(back_caches, layer, kv, [2, 3, 4]), want)
            assert not heads_of(back_caches, layer, kv, [0, 1, 5]).any(), "no other block written"
    for _, movers in (src, mid, back):
        for mover in movers:
            mover.close()
            mover.link.close()
