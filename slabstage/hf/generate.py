"""Greedy generation through the staging buffers and the graph runner: the example of how an engine wires
slabstage (prefill in chunks under a token budget, then decode steps; docs/hf.md, "Generation"), checked token
for token against HF's ``generate``.
"""

from __future__ import annotations

import hashlib
import os
import weakref
from dataclasses import dataclass, field, replace
from typing import Sequence

import torch

from ..cache.encoder_cache import CacheFullError, EncoderCache, StaleEntryError
from ..checks import check_int, is_int
from ..entry import Entry
from ..graph_runner.batch import PrefillBatch
from ..graph_runner.buckets import default_token_buckets
from ..graph_runner.runner import PrefillGraphRunner
from ..staging.buffers import StagingBuffers
from ._checks import as_prompt_ids, check_grid, check_pixels, grid_rows
from ._family import family_of, transformers_version
from .forward import prefill_forward
from .kv_cache import KVCache
from .media import media_items, pick_items
from .mrope import check_vlm_prompt, layout_rule, rope_index, rope_layout
from .pack import Request, item_spans, pack_requests
from .width import input_embeds_width

__all__ = ["Generator", "generate", "decode_buckets", "hf_generate", "content_keys"]


def decode_buckets(max_running: int) -> list[int]:
    """Batch sizes a decode step pads to: powers of two up to ``max_running`` (and it)."""
    sizes, b = [], 1
    while b < max_running:
        sizes.append(b)
        b *= 2
    return sizes + [max_running]


@dataclass
class _Seq:
    """One request while it runs: where its prompt stands, its KV-cache row, its new ids."""

    index: int  # position in the caller's list
    request: Request
    length: int  # prompt tokens
    row: int = -1  # its request row in the KV cache (-1: not admitted)
    done: int = 0  # prompt tokens prefilled
    delta: int = 0  # mrope: text position = token index + delta (HF's rope_deltas)
    new: list = field(default_factory=list)
    keys: list | None = None  # with an encoder cache: its items' keys (None: its media as given)
    grids: tuple = (None, None)  # its pixels' image and video grids, on the host
    spans: list | None = None  # with an encoder cache: each item's (first token, end) in the prompt


def _sequences(requests: Sequence[Request], max_new_tokens: int, max_context: int, where: str) -> list:
    """A :class:`_Seq` of each request, its prompt ids checked; raises naming the first request refused."""
    seqs = []
    for k, req in enumerate(requests):
        if not isinstance(req, Request):
            raise TypeError(f"{where} request {k}: a request must be a slabstage.hf.Request, got "
                            f"{type(req).__name__}")
        ids = as_prompt_ids(req.input_ids, f"{where} request {k}:")
        if ids.shape[0] + max_new_tokens > max_context:
            raise ValueError(f"{where} request {k}: {ids.shape[0]} prompt tokens and {max_new_tokens} new ones "
                             f"exceed the cache's max_context of {max_context}")
        seqs.append(_Seq(k, replace(req, input_ids=ids, chunk=None, req_index=None), ids.shape[0]))
    return seqs


def _eos_ids(model, eos_token_id) -> set:
    if eos_token_id is None:
        config = getattr(model, "generation_config", None)
        eos_token_id = getattr(config, "eos_token_id", None)
    if eos_token_id is None:
        return set()
    if isinstance(eos_token_id, int):
        return {eos_token_id}
    return {int(t) for t in eos_token_id}


def _rope_delta(fam, request: Request, ids: torch.Tensor) -> int:
    """HF's ``rope_deltas`` for one whole prompt: generated tokens take position ``index + delta``."""
    L = ids.shape[0]
    if request.mrope_positions is not None:
        return int(request.mrope_positions.max()) + 1 - L
    seconds = request.second_per_grid_ts
    images, videos, runs = check_vlm_prompt(fam, ids, request.image_grid_thw, request.video_grid_thw, seconds,
                                            "slabstage.hf.generate:")
    rule = layout_rule(transformers_version() or "0")
    if rule is None:
        return int(rope_index(fam, ids, images, videos, seconds).max()) + 1 - L
    return rope_layout(fam, runs, images, videos, seconds, 0, L, rule).position_delta(L)


def content_keys(pixels, grid, kind: str, encoder: bytes = b"") -> list:
    """One encoder-cache key per row of ``grid`` (``kind``: ``"image"`` or ``"video"``): the whole SHA-256 digest
    (32 bytes, never cut short) of ``encoder`` (what names the encoder: a cache two models share must not give
    one the other's outputs), the kind, the grid row, the pixels' dtype and width and the raw bytes of the item's
    pixel rows. Equal pixels under an equal grid give an equal key, in any request or call. The pixels are read
    on the host (one copy from a device)."""
    if pixels is None:
        return []
    host = pixels.detach().to("cpu").contiguous()
    keys, end = [], 0
    for t, h, w in grid.tolist():
        rows, end = host[end:end + t * h * w], end + t * h * w
        digest = hashlib.sha256(encoder + f"|{kind} {t} {h} {w} {host.dtype} {host.shape[1]}|".encode())
        digest.update(rows.reshape(-1).view(torch.uint8).numpy())
        keys.append(digest.digest())
    return keys


_ENCODERS = weakref.WeakKeyDictionary()  # model -> its tag in cache keys (the model object's, not a Generator's)


def _encoder_tag(model) -> bytes:
    """What names ``model``'s encoder in the keys of the items it encodes: random bytes drawn once for the model
    object, so that its Generators share their cache entries and another model's never match them."""
    tag = _ENCODERS.get(model)
    if tag is None:
        tag = _ENCODERS[model] = os.urandom(16)
    return tag


def _item_rows(item) -> int:
    """Rows of an item given as a tensor, as column blocks (a tuple or list of them) or as a cache entry."""
    if type(item) is Entry:
        return item.rows
    return (item[0] if type(item) in (tuple, list) else item).shape[0]


def _one_form(media: list) -> list:
    """A step's items (a list a chunk) as the staging takes them: as given when they are all tensors or all
    entries of one cache; else each entry as a view of its rows (a step that packs requests of both kinds)."""
    forms = {id(m.cache) if type(m) is Entry else 0 for ms in media if ms for m in ms}
    if len(forms) < 2:
        return media
    return [ms and [m.cache.rows_of(m) if type(m) is Entry else m for m in ms] for ms in media]


def _check_fits(cache: EncoderCache, rows: list, where: str) -> None:
    """:class:`CacheFullError` for an item of more rows than ``cache``'s device arena holds: raised as the
    requests are checked, before any of them runs (a cache that small could never stage it)."""
    room = cache.arena.shape[0]
    for j, n in enumerate(rows):
        if n > room:
            raise CacheFullError(f"{where} item {j} has {n} rows: an entry of {n} rows exceeds the encoder cache's "
                                 f"device budget of {room} rows ({cache.row_bytes} bytes a row); give it at least "
                                 f"{n * cache.row_bytes} bytes")


def _named_keys(tag: bytes, keys, count: int, where: str) -> list:
    """The cache keys of a request's ``media_keys`` (its caller's names of its ``count`` items, such as an
    engine's hashes of the original images), each behind the model's ``tag``; a type byte keeps ``b"1"``,
    ``"1"`` and ``1`` apart."""
    if type(keys) not in (list, tuple) or len(keys) != count:
        raise ValueError(f"{where} media_keys must be a list of {count} keys, one per item (images, then videos), "
                         f"got {keys!r:.80}")
    out = []
    for j, key in enumerate(keys):
        if type(key) is int:
            key = b"i" + str(key).encode()
        elif type(key) is str:
            key = b"s" + key.encode("utf-8", "surrogatepass")
        elif type(key) is bytes:
            key = b"b" + key
        else:
            raise TypeError(f"{where} media_keys[{j}] must be bytes, str or int (compared whole), got "
                            f"{type(key).__name__}")
        out.append(tag + key)
    return out


def generate(model, requests: Sequence[Request], *, max_new_tokens: int = 32, token_budget: int = 256,
             max_running: int | None = None, eos_token_id=None, graphs: bool = True,
             buckets: Sequence[int] | None = None, runner_options: dict | None = None,
             encoder_cache=None) -> list[list[int]]:
    """Greedy new ids for each of ``requests`` (a list per request, in order), scheduled like an engine.

    ``requests``: :class:`Request` s as :func:`pack_requests` takes them (their ``chunk`` is ignored: the
    scheduler cuts the chunks). ``max_new_tokens``: at most that many new ids each; a request also stops after
    an id in ``eos_token_id`` (default: the model's ``generation_config.eos_token_id``), which it includes, as
    HF's ``generate`` does. ``token_budget``: the most prompt tokens one prefill step packs (the staging
    buffers hold that many rows, or ``max_running`` when more: a decode step's); a prompt longer than what
    is left of it is prefilled over several steps.
    ``max_running``: requests in flight at once (KV-cache rows; default all of them). ``graphs``: on CUDA,
    capture the prefill buckets (``buckets``, default :func:`default_token_buckets` of the budget) and the
    decode batch sizes (:func:`decode_buckets`) and replay them; on the host the runner runs eagerly.
    ``runner_options``: further :class:`PrefillGraphRunner` keyword arguments.

    Media: a request's ``media`` (encoded items), or its ``pixel_values`` / ``pixel_values_videos`` with the
    grids, which are encoded here. ``encoder_cache``: an :class:`~slabstage.cache.EncoderCache` at the slab's
    width on the model's device (or a byte budget: one is made at the slab's width and dtype); pixels are then
    keyed by content (:func:`content_keys`) and encoded through it, misses only.

    Builds a :class:`Generator` for these requests (buffers, cache, graphs) and runs it; an engine keeps one.
    """
    requests = list(requests)
    if not requests:
        family_of(model, "generate")
        return []
    _check_int("max_new_tokens", max_new_tokens)
    running = len(requests) if max_running is None else _check_int("max_running", max_running)
    lengths = [as_prompt_ids(r.input_ids, f"slabstage.hf.generate: request {k}:").shape[0]
               if isinstance(r, Request) else 1 for k, r in enumerate(requests)]
    engine = Generator(model, max_running=min(running, len(requests)), max_context=max(lengths) + max_new_tokens,
                       token_budget=token_budget, graphs=graphs, buckets=buckets, runner_options=runner_options,
                       encoder_cache=encoder_cache)
    return engine.generate(requests, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id)


def _check_int(name: str, value) -> int:
    return check_int(f"slabstage.hf.generate: {name}", value, lo=1)


class Generator:
    """The staging buffers, KV cache and graph runner that :func:`generate` schedules over, kept across calls
    (an engine allocates and captures once): ``max_running`` requests in flight (KV-cache rows) of at most
    ``max_context`` tokens (prompt and new ids), ``token_budget`` tokens a prefill step; ``graphs``,
    ``buckets``, ``runner_options``, ``encoder_cache`` as :func:`generate` takes them (``self.encoder_cache``: the
    cache, kept across calls). Captures on construction on CUDA."""

    def __init__(self, model, *, max_running: int, max_context: int, token_budget: int = 256, graphs: bool = True,
                 buckets: Sequence[int] | None = None, runner_options: dict | None = None,
                 encoder_cache=None) -> None:
        fam = family_of(model, "generate")
        for name, value in (("max_running", max_running), ("max_context", max_context),
                            ("token_budget", token_budget)):
            _check_int(name, value)
        taken = sorted({"buckets", "enforce_eager"} & set(runner_options or ()))
        if taken:
            raise ValueError(f"slabstage.hf.generate: runner_options sets {taken[0]!r}, which generate sets itself: "
                             f"pass buckets= (prefill buckets) or graphs= instead")
        lm_param = next(fam.language_model.parameters())
        self.model, self.fam, self.budget, self.max_running = model, fam, token_budget, max_running
        self.device, self.dtype = lm_param.device, lm_param.dtype
        self.head = model.get_output_embeddings()
        capacity = max(token_budget, max_running)  # (a decode step has a row a running request)
        width = input_embeds_width(model)
        self.encoder_cache = self._own_cache(encoder_cache, width)
        self._calls = 0  # generate() calls (the keys of items given as tensors name theirs, and this generator)
        self._tag = os.urandom(16).hex()
        self.buffers = StagingBuffers.allocate(max_num_tokens=capacity, max_batch_size=max_running,
                                               embed_width=width, embed_dtype=self.dtype,
                                               device=self.device, mrope=fam.is_vlm)
        self.cache = KVCache.allocate(model, max_running, max_context)
        forward = prefill_forward(model, cache=self.cache)
        ladder = sorted(set(decode_buckets(max_running)) | set(buckets or default_token_buckets(token_budget)))
        self.runner = PrefillGraphRunner(forward, self.buffers, buckets=[b for b in ladder if b <= capacity],
                                         enforce_eager=not graphs, **{"progress": False, **(runner_options or {})})
        if graphs and self.device.type == "cuda":
            with torch.no_grad():
                self.runner.capture()

    def _own_cache(self, cache, width: int):
        where = "slabstage.hf.generate: encoder_cache"
        if cache is None:
            return None
        if not self.fam.is_vlm:
            raise ValueError(f"{where}: {type(self.model).__name__} ({self.fam.name}) is a text-only model")
        if not isinstance(cache, EncoderCache):
            if not is_int(cache):
                raise TypeError(f"{where} must be a slabstage.cache.EncoderCache or a byte budget (int), got "
                                f"{type(cache).__name__}")
            return EncoderCache(width, self.dtype, self.device, cache)
        if cache.width != width or cache.device != self.device:
            raise ValueError(f"{where} holds rows of {cache.width} columns on {cache.device}; this model's slab is "
                             f"{width} columns on {self.device}")
        return cache

    def _prepare(self, seq: _Seq) -> None:
        """A request's pixels: encoded now (no encoder cache) or keyed by its ``media_keys`` or by content (encoded
        at its prefill); with a cache, items given as tensors get its ``media_keys`` or keys of this call. Its
        ``media`` is left as placeholders of its rows for the checks."""
        req, where, cache = seq.request, f"slabstage.hf.generate: request {seq.index}:", self.encoder_cache
        if not self.fam.is_vlm:
            return
        if req.pixel_values is None and req.pixel_values_videos is None:
            if cache is not None and req.media:
                seq.keys = [f"slabstage.hf.generate {self._tag} call {self._calls} request {seq.index} item {j}"
                            for j in range(len(req.media))] if req.media_keys is None else \
                    _named_keys(_encoder_tag(self.model), req.media_keys, len(req.media), where)
                _check_fits(cache, list(map(_item_rows, req.media)), where)
            return
        if req.media:
            raise ValueError(f"{where} it gives both media and pixels: give one of them")
        merge = self.fam.merge
        grids = []
        for pixels, grid, name, pixels_name in ((req.pixel_values, req.image_grid_thw, "image_grid_thw",
                                                 "pixel_values"), (req.pixel_values_videos, req.video_grid_thw,
                                                                   "video_grid_thw", "pixel_values_videos")):
            host = check_grid(grid, name, where, merge)
            if (pixels is None) != (host is None):
                raise ValueError(f"{where} {pixels_name} and {name} come together")
            if host is not None:
                check_pixels(pixels, host, pixels_name, name, where)
            grids.append(host)
        if cache is None:
            items = media_items(self.model, req.pixel_values, req.image_grid_thw, req.pixel_values_videos,
                                req.video_grid_thw)
            seq.request = replace(req, media=items, pixel_values=None, pixel_values_videos=None)
            return
        tag, rows = _encoder_tag(self.model), grid_rows(grids[0], merge) + grid_rows(grids[1], merge)
        _check_fits(cache, rows, where)
        seq.keys = _named_keys(tag, req.media_keys, len(rows), where) if req.media_keys is not None else \
            content_keys(req.pixel_values, grids[0], "image", tag) + \
            content_keys(req.pixel_values_videos, grids[1], "video", tag)
        seq.grids = tuple(grids)
        seq.request = replace(req, media=[torch.empty(n, 0) for n in rows])  # (the checks read their rows)

    def _media(self, chunks: list, last: bool = False) -> list | None:
        """Each chunk's request's items for a prefill step (``chunks``: ``(seq, start, end)``): as given, or (with
        an encoder cache) the entries of the items the chunk reads, the misses encoded now, and placeholders of
        the others; None when an entry taken for this step was evicted by a later one of it (the budget cannot
        hold the step's items at once; ``last``: raise that :class:`CacheFullError` instead)."""
        cache, out, taken = self.encoder_cache, [], []
        for seq, a, b in chunks:
            req = seq.request
            if seq.keys is None:
                out.append(req.media)
                continue
            media = list(req.media)  # the given items, or their placeholders: pack_requests takes those read
            read = [j for j, (first, end) in enumerate(seq.spans) if first < b and end > a]
            try:
                if req.pixel_values is None and req.pixel_values_videos is None:  # items given as tensors
                    for j in read:
                        item = media[j]
                        if type(item) is Entry:
                            if item.cache is cache:  # (an entry of this cache is staged where it lies)
                                continue
                            item = item.cache.rows_of(item)  # (another cache's: copied in, as a tensor is)
                        item = tuple(item) if type(item) is list else item
                        media[j] = cache.get(seq.keys[j], rows=_item_rows(item)) or cache.put(seq.keys[j], item)
                        taken.append(media[j])
                elif read:
                    for j, entry in zip(read, self._encode(seq, read)):
                        media[j] = entry
                        taken.append(entry)
            except CacheFullError as e:  # (the budget could not hold the step's items at once)
                if last:
                    raise CacheFullError(f"slabstage.hf.generate: request {seq.index}: the encoder cache cannot "
                                         f"hold the items of tokens [{a}, {b}): {e}") from e
                return None
            out.append(media)
        if cache is None:
            return _one_form(out)
        return None if any(cache.gens[e.slot] != e.gen for e in taken) else out

    def _encode(self, seq: _Seq, read: list) -> list:
        """The cache entries of items ``read`` (indices in ``seq``'s items, in order) of a request that gives
        pixels, encoded through the cache (misses only)."""
        req, (images, videos) = seq.request, seq.grids
        first_video = 0 if images is None else len(images)
        which = [j for j in read if j < first_video], [j - first_video for j in read if j >= first_video]
        given = {}
        if which[0]:
            given["pixel_values"], given["image_grid_thw"] = pick_items(req.pixel_values, images, which[0])
        if which[1]:
            given["pixel_values_videos"], given["video_grid_thw"] = pick_items(req.pixel_values_videos, videos,
                                                                              which[1])
        return media_items(self.model, **given, encoder_cache=self.encoder_cache, keys=[seq.keys[j] for j in read])

    @torch.no_grad()
    def generate(self, requests: Sequence[Request], *, max_new_tokens: int = 32, eos_token_id=None) -> list:
        """:func:`generate` over this generator's buffers, caches and graphs (without autograd, as HF's)."""
        fam, where = self.fam, "slabstage.hf.generate:"
        _check_int("max_new_tokens", max_new_tokens)
        self._calls += 1
        seqs = _sequences(requests, max_new_tokens, self.cache.max_context, where)
        if not seqs:
            return []
        for seq in seqs:
            self._prepare(seq)
        pack_requests(self.model, [s.request for s in seqs])  # every request's checks before anything runs
        keyed = [s for s in seqs if s.keys is not None]
        for seq, spans in zip(keyed, item_spans(self.model, [s.request for s in keyed]) if keyed else ()):
            seq.spans = spans  # (a chunk encodes and holds the items it reads alone)
        if fam.is_vlm:
            for seq in seqs:
                seq.delta = _rope_delta(fam, seq.request, seq.request.input_ids)
        eos = _eos_ids(self.model, eos_token_id)
        held = self._hold_given(seqs)  # {request: the entries of this cache it gives}, until it is prefilled
        try:
            waiting, running = list(seqs), []
            free = list(range(self.max_running))
            while waiting or running:
                while waiting and free:
                    seq = waiting.pop(0)
                    seq.row = free.pop(0)
                    running.append(seq)
                prefill = [s for s in running if s.done < s.length]
                picked = self._prefill(prefill) if prefill else self._decode(running)
                done = [s.index for s in prefill if s.done == s.length and s.index in held]
                self._release({i: held.pop(i) for i in done})
                for seq, token in picked:
                    seq.new.append(token)
                    if token in eos or len(seq.new) >= max_new_tokens:
                        running.remove(seq)
                        free.append(seq.row)
        finally:
            self._release(held)
        for seq in seqs:  # (the entries of items given as tensors, unnamed, were this call's)
            req = seq.request
            if seq.keys and req.media_keys is None and req.pixel_values is None and req.pixel_values_videos is None:
                for key in seq.keys:
                    self.encoder_cache.evict(key)
        return [s.new for s in seqs]

    def _hold_given(self, seqs: list) -> dict:
        """``{request index: entries}``: the entries of this generator's cache that requests give as items, held
        until their request is prefilled (another request's put must not evict them first); a stale one raises
        :class:`StaleEntryError` naming its request."""
        cache, held = self.encoder_cache, {}
        try:
            for seq in seqs if cache is not None else ():
                for j, item in enumerate(seq.request.media if seq.keys is not None else ()):
                    if type(item) is Entry and item.cache is cache:
                        try:
                            cache.hold(item)
                        except StaleEntryError as e:
                            raise StaleEntryError(f"slabstage.hf.generate: request {seq.index}: item {j}: {e}") \
                                from None
                        held.setdefault(seq.index, []).append(item)
        except BaseException:
            self._release(held)
            raise
        return held

    def _release(self, held: dict) -> None:
        for entries in held.values():
            for entry in entries:
                self.encoder_cache.release(entry)

    def _sample(self, hidden: torch.Tensor) -> list:
        """Greedy ids of ``hidden`` (the rows to sample, one a request): the LM head on them; one read back."""
        return self.head(hidden).float().argmax(-1).tolist()  # the step's one host sync: the scheduler needs them

    def _prefill(self, seqs: list) -> list:
        """One step of prompt chunks, in order, under the token budget: ``[(seq, first new id)]`` for the
        requests whose prompt this step completes."""
        left, chunks = self.budget, []
        for seq in seqs:
            if not left:
                break
            n = min(seq.length - seq.done, left)
            chunks.append((seq, seq.done, seq.done + n))
            left -= n
        media = self._media(chunks)
        if media is None:  # the cache cannot hold the step's items at once: this step prefills the first chunk
            chunks = chunks[:1]
            media = self._media(chunks)
        if media is None:  # its items fit the budget but not the free runs between entries: the cache starts over
            self.encoder_cache.evict_unheld()  # (but for the entries requests give, held until they are prefilled)
            media = self._media(chunks)
        if media is None:  # nor all of the chunk's items: the chunk stops before the second item it reads
            seq, a, b = chunks[0]
            starts = sorted(first for first, end in seq.spans if first < b and end > a)
            chunks = [(seq, a, starts[1] if len(starts) > 1 else b)]
            media = self._media(chunks, last=True)
        batch = pack_requests(self.model, [replace(s.request, chunk=(a, b), media=m)
                                           for (s, a, b), m in zip(chunks, media)])
        # the KV-cache inputs of the cache's default layout (filled at allocation: nothing to write into
        # req_to_token, so no host-to-device copy beside the runner's one); the runner checks them with the rest
        for name, value in self.cache.batch_slots([s.row for s, _, _ in chunks], [a for _, a, _ in chunks],
                                              [b - a for _, a, b in chunks]).items():
            setattr(batch, name, value)
        hidden = self.runner.run(batch)
        rows, ends, finished = 0, [], []
        for seq, a, b in chunks:
            rows += b - a
            seq.done = b
            if b == seq.length:
                ends.append(rows - 1)
                finished.append(seq)
        if not finished:
            return []
        index = torch.tensor(ends, dtype=torch.int64).to(self.device, non_blocking=True)
        return list(zip(finished, self._sample(hidden.index_select(0, index))))

    def _decode(self, seqs: list) -> list:
        """One decode step: each running request's last id at its next position: ``[(seq, new id)]``."""
        last = torch.tensor([s.new[-1] for s in seqs], dtype=torch.int64)
        where = [s.length + len(s.new) - 1 for s in seqs]  # the index of the token fed in
        positions = torch.tensor(where, dtype=torch.int64)
        mrope = None
        if self.fam.is_vlm:
            mrope = (positions + torch.tensor([s.delta for s in seqs], dtype=torch.int64)).expand(3, -1).contiguous()
        batch = PrefillBatch(input_ids=last, positions=positions, table=self.fam.language_model.embed_tokens.weight,
                             mrope_positions=mrope, seq_lens=torch.ones(len(seqs), dtype=torch.int32),
                             extend_start_loc=torch.arange(len(seqs), dtype=torch.int32),
                             **self.cache.batch_slots([s.row for s in seqs], where, [1] * len(seqs)))
        hidden = self.runner.run(batch)
        return list(zip(seqs, self._sample(hidden[:len(seqs)])))  # (row k: request k)


def hf_generate(model, max_new_tokens: int, eos_token_id=None, **inputs) -> list[int]:
    """The reference: HF's own greedy ``model.generate(**inputs, do_sample=False)`` for one prompt
    (``inputs``: ``input_ids [1, L]`` and its media keyword arguments), its new ids as a list."""
    device = next(model.parameters()).device
    inputs = {k: v.to(device) if isinstance(v, torch.Tensor) and k != "second_per_grid_ts" else v
              for k, v in inputs.items()}
    ids = inputs["input_ids"]
    extra = {} if eos_token_id is None else dict(eos_token_id=eos_token_id)
    with torch.no_grad():
        out = model.generate(**inputs, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=0, **extra)
    return out[0, ids.shape[1]:].tolist()
