"""Where a batch of ``n`` tokens runs: a :class:`Route`, its bucket's graph or eagerly for a reason code.

``runner.last_fallback`` and the keys of ``runner.stats()["eager"]`` are these codes.
"""

from __future__ import annotations

import bisect
from typing import NamedTuple

import torch

__all__ = ["Route", "EAGER", "NO_CUDA", "ENFORCE_EAGER", "NOT_CAPTURED", "ABOVE_LARGEST", "PADDING", "REPLAY_DIFFERS",
           "REPLAY_SLOWER", "CAPTURING", "DROPPED_WORDS", "routes_by_size", "eager_words"]

# why a run() ran eagerly (runner.last_fallback; runner.stats()["eager"])
NO_CUDA, ENFORCE_EAGER, NOT_CAPTURED = "no_cuda", "enforce_eager", "not_captured"
ABOVE_LARGEST, PADDING = "above_largest_bucket", "padding_ratio"
REPLAY_DIFFERS, REPLAY_SLOWER = "replay_differs", "replay_slower"  # the capture check dropped the bucket
CAPTURING = "capturing"  # capture(lazy=True): the batch ran eagerly, then its bucket was captured

# "the N-token bucket's replay <words> the eager forward", for a bucket the capture check dropped
DROPPED_WORDS = {REPLAY_DIFFERS: "differs from", REPLAY_SLOWER: "is slower than"}


class Route(NamedTuple):
    """Where a batch runs: ``bucket``'s graph replays it, or it runs eagerly for ``why``; the other is None."""

    bucket: int | None
    why: str | None


# the eager route of each reason code
EAGER = {why: Route(None, why) for why in (NO_CUDA, ENFORCE_EAGER, NOT_CAPTURED, ABOVE_LARGEST, PADDING,
                                           REPLAY_DIFFERS, REPLAY_SLOWER, CAPTURING)}


def routes_by_size(buckets: list[int], max_padding_ratio: float, pending: set, dropped: dict) -> list[Route]:
    """The route of every token count up to the largest bucket, for an O(1) look-up on the run path.

    ``routes[n]`` for ``1 <= n <= buckets[-1]`` replays ``n``'s bucket (the smallest one >= ``n``), or runs
    eagerly: for ``PADDING`` when that bucket exceeds ``n * max_padding_ratio``, ``CAPTURING`` when it is in
    ``pending``, ``dropped[bucket]`` when the capture check dropped it. ``routes[0]`` runs eagerly for
    ``ABOVE_LARGEST`` (no batch has 0 tokens). ``buckets`` ascend.
    """
    replay = {b: Route(b, None) for b in buckets}
    routes = [EAGER[ABOVE_LARGEST]]
    for n in range(1, buckets[-1] + 1):
        b = buckets[bisect.bisect_left(buckets, n)]
        why = PADDING if b > n * max_padding_ratio else CAPTURING if b in pending else dropped.get(b)
        routes.append(replay[b] if why is None else EAGER[why])
    return routes


def eager_words(why: str, device: torch.device) -> str | None:
    """Why the whole runner runs eagerly, in words for its log line; None for a reason of one batch only."""
    if why == NO_CUDA:
        return "no CUDA device" if not torch.cuda.is_available() else f"buffers on {device}"
    if why == ENFORCE_EAGER:
        return "enforce_eager=True"
    if why == NOT_CAPTURED:
        return "no graphs captured: capture() was not called or failed"
    return None
