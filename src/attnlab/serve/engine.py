"""Continuous batching for decoder-only models: one background thread per model owns the network;
requests join the running decode batch between steps and leave it when they finish.

How a step works. The batch keeps one KV cache for all its rows (per layer, K/V of shape
(rows, kv_heads, length, head_dim)), *right-aligned*: every row's last token sits in the last
column, and a row shorter than the longest is left-padded, with a key mask (rows, length) marking
its real tokens. That is exactly the layout ``DecoderOnly.forward`` already accepts for
left-padded batches: positions are counted over real tokens only (``cumsum(mask) - 1``) and the
padding is masked out of attention, so a padded row computes what the prompt alone computes.

* A new request is **prefilled alone** (batch of one, no padding: the very computation
  ``attnlab.generate`` does) into its own cache; its first token comes from that prefill. Between
  two decode steps its K/V are then spliced into the batch cache, left-padded (or the batch is
  left-padded, if the newcomer is longer).
* Each **decode step** feeds the newest token of every row, (rows, 1), one forward for the batch;
  each row then picks its next token with its own options (greedy, or temperature / top-p
  sampling from its own seeded ``torch.Generator``, as ``stream_tokens`` does for one prompt;
  the greedy rows share one argmax).
* Finished rows (EOS, their token budget, a stop string, a client that went away) are dropped
  from the cache (``DecoderCache.reorder``); columns that have become padding in every row are cut
  off the left, so the batch never pays for requests that left.

Identical to "served alone": a row's positions, its keys and its mask are those of the request
alone; the only difference is which other rows share the matrix products, which changes nothing
mathematically (rows are independent) and can at most move the last bits of float rounding.
The tests check greedy outputs token for token against ``LoadedModel.generate``.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from ..generate.processors import LogitsProcessor, top_k_top_p
from ..generate.search import GenerationConfig


class QueueFull(Exception):
    """The engine's waiting queue is full (HTTP 429)."""


_ids = itertools.count()


@dataclass
class Request:
    """One generation: prompt ids, a budget and sampling options. Events come back on ``queue``
    (an asyncio.Queue of the caller's loop): ("token", id), then ("done", "stop"|"length"), or
    ("error", message)."""
    prompt: list[int]
    max_new_tokens: int
    temperature: float = 0.0          # 0: greedy
    top_p: float = 1.0
    seed: int | None = None
    loop: asyncio.AbstractEventLoop | None = None
    queue: asyncio.Queue | None = None
    id: int = field(default_factory=lambda: next(_ids))
    cancelled: bool = False
    submitted: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    generated: list[int] = field(default_factory=list)
    # set by the engine
    _gen: torch.Generator | None = None
    _process: LogitsProcessor | None = None
    _cfg: GenerationConfig | None = None

    def cancel(self) -> None:
        """The caller no longer wants tokens (a stop string, a disconnect): leave the batch."""
        self.cancelled = True

    def _emit(self, event: tuple) -> None:
        if self.loop is not None and self.queue is not None:
            try:
                self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                self.cancelled = True


class Engine:
    """Continuous batching over one ``DecoderOnly`` model (``LoadedModel`` of kind ``lm``)."""

    def __init__(self, model, max_batch: int = 16, max_queue: int = 256, on_step=None, on_first_token=None):
        self.model = model                     # LoadedModel
        self.net = model.module
        self.max_batch, self.max_queue = max_batch, max_queue
        self.eos_id = self.net.config.eos_id
        self.pad_id = self.net.config.pad_id
        self.on_step = on_step                 # callback(batch_size) after every decode step
        self.on_first_token = on_first_token   # callback(seconds from submit to first token)
        self._pending: deque[Request] = deque()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stop = False
        # the batch
        self._rows: list[Request] = []
        self._cache = None
        self._mask: torch.Tensor | None = None     # (rows, length) bool: real tokens
        self._last: torch.Tensor | None = None     # (rows,) newest token of each row
        self.steps = 0

    # -- the caller's side (any thread) -----------------------------------------------------------------
    @property
    def queue_depth(self) -> int:
        return len(self._pending)

    @property
    def batch_size(self) -> int:
        return len(self._rows)

    def submit(self, req: Request) -> Request:
        with self._cv:
            free = max(0, self.max_batch - len(self._rows))  # requests that join at the next step do not wait
            if len(self._pending) - free >= self.max_queue:
                raise QueueFull(f"the queue of {self.model.name} is full ({self.max_queue} waiting requests)")
            self._pending.append(req)
            self._start()
            self._cv.notify()
        return req

    def _start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._stop = False
            self._thread = threading.Thread(target=self._run, name=f"attnlab-engine-{self.model.name}", daemon=True)
            self._thread.start()

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout=10)

    # -- the engine thread ----------------------------------------------------------------------------------
    def _run(self) -> None:
        with torch.inference_mode():
            while True:
                with self._cv:
                    while not self._stop and not self._pending and not self._rows:
                        self._cv.wait()
                    if self._stop:
                        break
                    admit = []
                    while self._pending and len(self._rows) + len(admit) < self.max_batch:
                        admit.append(self._pending.popleft())
                for req in admit:
                    try:
                        if not req.cancelled:
                            self._prefill(req)
                    except Exception as e:  # this request fails; the batch goes on
                        req._emit(("error", f"{type(e).__name__}: {e}"))
                try:
                    self._drop_finished()
                    if self._rows:
                        self._step()
                        self._drop_finished()
                except Exception as e:  # a bug or out of memory: fail the batch, keep serving
                    for req in self._rows:
                        req._emit(("error", f"{type(e).__name__}: {e}"))
                    self._reset()
            for req in list(self._rows) + list(self._pending):
                req._emit(("error", "the server is shutting down"))
            self._reset()

    def _reset(self) -> None:
        self._rows, self._cache, self._mask, self._last = [], None, None, None

    def _pick(self, req: Request, logits: torch.Tensor) -> int:
        """The next token of one row from its (1, V) logits: what ``stream_tokens`` does for it alone."""
        logits = req._process(logits, lambda: [req.generated], len(req.generated))
        if req._cfg.do_sample:
            logits = top_k_top_p(logits / req._cfg.temperature, req._cfg.top_k, req._cfg.top_p)
            return int(torch.multinomial(logits.softmax(-1), 1, generator=req._gen).item())
        return int(logits.argmax(-1).item())

    def _accept(self, req: Request, token: int) -> bool:
        """Record a token; whether the request goes on."""
        if req.first_token_at is None:
            req.first_token_at = time.perf_counter()
            if self.on_first_token:
                self.on_first_token(req.first_token_at - req.submitted)
        if token == self.eos_id:
            req._emit(("done", "stop"))
            return False
        req.generated.append(token)
        req._emit(("token", token))
        if len(req.generated) >= req.max_new_tokens:
            req._emit(("done", "length"))
            return False
        return True

    def _prefill(self, req: Request) -> None:
        """The prompt alone (batch of one, as ``generate`` runs it), then its K/V join the batch."""
        cfg = GenerationConfig(do_sample=req.temperature > 0, temperature=req.temperature or 1.0, top_p=req.top_p,
                               seed=req.seed, max_new_tokens=req.max_new_tokens)
        req._cfg = cfg
        dev = self.net.device
        req._gen = torch.Generator(device=dev).manual_seed(req.seed) if req.seed is not None else None
        if req._gen is None and cfg.do_sample:
            req._gen = torch.Generator(device=dev)
            req._gen.seed()
        req._process = LogitsProcessor(cfg, self.eos_id, [list(req.prompt)], self.pad_id)
        cache = self.net.new_cache(len(req.prompt) + req.max_new_tokens + 1)
        x = torch.tensor([req.prompt], device=dev)
        logits = self.net(x, None, cache=cache, last_only=True).float()
        token = self._pick(req, logits)
        if not self._accept(req, token):
            return
        self._join(req, cache, token)

    def _join(self, req: Request, cache, token: int) -> None:
        """Splice a prefilled request into the right-aligned batch cache."""
        P = cache.length
        dev = self.net.device
        if not self._rows:
            self._rows, self._cache = [req], cache
            self._mask = torch.ones(1, P, dtype=torch.bool, device=dev)
            self._last = torch.tensor([token], device=dev)
            return
        L = self._cache.length
        N = max(L, P)
        B = len(self._rows)
        room = N + 64
        for (bc, _), (nc, _) in zip(self._cache.layers, cache.layers):
            shape = (B + 1, bc.k.shape[1], room, bc.k.shape[3])
            k, v = bc.k.new_zeros(shape), bc.v.new_zeros(shape)
            k[:B, :, N - L: N] = bc.k[:, :, :L]
            v[:B, :, N - L: N] = bc.v[:, :, :L]
            k[B:, :, N - P: N] = nc.k[:, :, :P]
            v[B:, :, N - P: N] = nc.v[:, :, :P]
            bc.k, bc.v, bc.length = k, v, N
        mask = torch.zeros(B + 1, N, dtype=torch.bool, device=dev)
        mask[:B, N - L:] = self._mask
        mask[B, N - P:] = True
        self._mask = mask
        self._last = torch.cat([self._last, torch.tensor([token], device=dev)])
        self._rows.append(req)

    def _step(self) -> None:
        """One token for every row of the batch."""
        B = len(self._rows)
        mask = torch.cat([self._mask, self._mask.new_ones(B, 1)], 1)
        full = bool(mask.all())
        logits = self.net(self._last[:, None], None if full else mask, cache=self._cache, last_only=True).float()
        self._mask = mask
        self.steps += 1
        if self.on_step:
            self.on_step(B)
        # greedy rows without penalties: one argmax for all of them (what _pick does row by row)
        plain = [i for i, r in enumerate(self._rows) if not r._cfg.do_sample and not r._process.needs_history
                 and r._cfg.min_new_tokens == 0]
        greedy = {}
        if plain:
            rows = logits[plain] if len(plain) < B else logits
            if self.pad_id is not None and self.pad_id != self.eos_id:
                rows[:, self.pad_id] = float("-inf")
            greedy = dict(zip(plain, rows.argmax(-1).tolist()))
        nxt = []
        for i, req in enumerate(self._rows):
            t = self.eos_id if req.cancelled else greedy[i] if i in greedy else self._pick(req, logits[i: i + 1])
            nxt.append(t)
            if not req.cancelled and not self._accept(req, t):
                req.cancelled = True  # done: leaves the batch below
        self._last = torch.tensor(nxt, device=self._last.device)

    def _drop_finished(self) -> None:
        keep = [i for i, r in enumerate(self._rows) if not r.cancelled]
        if len(keep) == len(self._rows):
            return
        if not keep:
            self._reset()
            return
        index = torch.tensor(keep, device=self._last.device)
        self._cache.reorder(index)
        self._mask = self._mask.index_select(0, index)
        self._last = self._last.index_select(0, index)
        self._rows = [self._rows[i] for i in keep]
        # columns that are padding in every remaining row: cut them off the left
        first = int(self._mask.any(0).long().argmax())
        if first:
            for c, _ in self._cache.layers:
                c.k, c.v, c.length = c.k[:, :, first:], c.v[:, :, first:], c.length - first
            self._mask = self._mask[:, first:]
