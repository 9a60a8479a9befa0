"""Continuous batching: one background thread per model owns the network; requests join the running
batch between steps and leave it when they finish. Three engines share that loop (``_EngineLoop``):

* :class:`Engine` — decoder-only language models, one token per step for every request;
* :class:`TranslationEngine` — encoder-decoder translation, beam search included: every request
  brings its K beams as K rows of the shared decoder batch and runs its own ``BeamSearch``;
* :class:`BatchEngine` — encoders (embeddings, classification): the requests that are waiting when
  the model is free are run as one batch.

Anything else that must touch a model (the attention maps of ``/v1/attention``) is a :class:`Call`
run on the model's own thread between two steps, so no two threads ever use one model at once.

The decoder-only engine. How a step works: The batch keeps one KV cache for all its rows (per layer, K/V of shape
(rows, kv_heads, length, head_dim)), *right-aligned*: every row's last token sits in the last
column, and a row shorter than the longest is left-padded, with a key mask (rows, length) marking
its real tokens. That is exactly the layout ``DecoderOnly.forward`` already accepts for
left-padded batches: positions are counted over real tokens only (``cumsum(mask) - 1``) and the
padding is masked out of attention, so a padded row computes what the prompt alone computes.

* The requests that arrive between two steps are **prefilled together**, left-padded (one request
  alone: no padding, the very computation ``attnlab.generate`` does), into their own cache; each
  row's first token comes from that prefill. Their K/V are then spliced into the batch cache,
  left-padded (or the batch is left-padded, if the newcomers are longer).
* Each **decode step** feeds the newest token of every row, (rows, 1), one forward for the batch;
  each row then picks its next token with its own options (greedy, or temperature / top-p
  sampling from its own seeded ``torch.Generator``, as ``stream_tokens`` does for one prompt;
  the greedy rows share one argmax).
* Finished rows (EOS, their token budget, a stop string, a client that went away) leave the
  cache: the batch's last rows move into their places; once ``CUT_MIN`` columns have become padding
  in every row they are cut off the left, so the batch does not keep paying for requests that left.
  All of it in place, in buffers with rows to spare (``Engine._rebuild``).

Identical to "served alone": a row's positions, its keys and its mask are those of the request
alone; the only difference is which other rows share the matrix products, which changes nothing
mathematically (rows are independent) and can at most move the last bits of float rounding.
The tests check greedy outputs token for token against ``LoadedModel.generate``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..accel import compiled_step
from ..generate.processors import LogitsProcessor, top_k_top_p
from ..generate.search import MIN_TEMPERATURE, BeamSearch, GenerationConfig, translation_budget
from ..quant import quantized_kind

log = logging.getLogger("attnlab")


def _served_step(net, fn, compile: bool):
    """The engine's decoding step: ``fn``, or its ``accel.compiled_step`` with ``compile`` (dynamic
    shapes; eager where that is impossible). A language model's engine compiles it before serving
    (``Engine.warm_up``) and never again after. Quantised models stay eager here: tried with
    SmolLM2 int8 (2026-12-01), six concurrent requests waited ~8 minutes while the step was compiled
    and autotuned again for the new batch shapes and masks, and one of the six greedy answers differed
    from its answer alone (inductor's GEMMs round differently per batch size). ``generate(...,
    compile=True)`` is where they compile."""
    if compile and quantized_kind(net) is not None:
        log.info("serve --compile: %s is quantised, its decoding step stays eager", type(net).__name__)
        return fn
    return compiled_step(net, fn) if compile else fn


class QueueFull(Exception):
    """The engine's waiting queue is full (HTTP 429)."""


_ids = itertools.count()


@dataclass(kw_only=True)
class Job:
    """What every engine request has: where its events go and whether its caller still wants them.
    Events come back on ``queue`` (an asyncio.Queue of the caller's loop)."""
    loop: asyncio.AbstractEventLoop | None = None
    queue: asyncio.Queue | None = None
    id: int = field(default_factory=lambda: next(_ids))
    cancelled: bool = False
    submitted: float = field(default_factory=time.perf_counter)

    def cancel(self) -> None:
        """The caller no longer wants results (a stop string, a disconnect): leave the batch."""
        self.cancelled = True

    def _emit(self, event: tuple) -> None:
        if self.loop is not None and self.queue is not None:
            try:
                self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                self.cancelled = True

    async def result(self):
        """The value of the ("done", value) event (for engines that answer once); an error the engine
        met is raised here, in the caller."""
        kind, value = await self.queue.get()
        if kind == "error":
            raise value
        return value


@dataclass
class Request(Job):
    """One generation of a language model: prompt ids, a budget and sampling options. Events:
    ("token", id) ..., then ("done", "stop"|"length"), or ("error", exception)."""
    prompt: list[int]
    max_new_tokens: int
    temperature: float = 0.0          # 0 (or under MIN_TEMPERATURE): greedy
    top_p: float = 1.0
    seed: int | None = None
    first_token_at: float | None = None
    generated: list[int] = field(default_factory=list)
    # set by the engine
    _gen: torch.Generator | None = None
    _process: LogitsProcessor | None = None
    _cfg: GenerationConfig | None = None


@dataclass
class TranslationJob(Job):
    """One source sentence (ids, EOS included) and its search options. Event: ("done", n-best
    hypotheses, best first) or ("error", exception)."""
    src: list[int]
    cfg: GenerationConfig
    search: BeamSearch | None = None  # set by the engine


@dataclass
class Call(Job):
    """A function to run on the model's own thread between two steps. Event: ("done", its value)."""
    fn: Callable[[], Any]
    rows: int = 0


@dataclass
class Batch(Job):
    """Inputs for a batched function (``LoadedModel.embed`` or ``.classify``). Event: ("done", one output
    per input)."""
    inputs: list
    fn: Callable[[list], Any]


class _EngineLoop:
    """The thread, the waiting queue and the step loop that every engine shares. Subclasses say how
    a job joins the batch (``_admit``), what one step does (``_step``) and how finished rows leave
    (``_drop_finished``)."""

    def __init__(self, model, max_batch: int = 16, max_queue: int = 256):
        self.model = model                     # LoadedModel
        self.net = model.module
        self.max_batch, self.max_queue = max_batch, max_queue
        self._pending: deque[Job] = deque()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stop = False
        self._rows: list[Job] = []             # the jobs in the running batch
        self.steps = 0

    # -- the caller's side (any thread) ---------------------------------------------------------------------
    @property
    def queue_depth(self) -> int:
        with self._cv:
            return sum(not job.cancelled for job in self._pending)

    @property
    def batch_size(self) -> int:
        return len(self._rows)

    def submit(self, job: Job) -> Job:
        with self._cv:
            if any(j.cancelled for j in self._pending):  # (their clients left: they wait for nothing)
                self._pending = deque(j for j in self._pending if not j.cancelled)
            free = max(0, self.max_batch - len(self._rows))  # requests that join at the next step do not wait
            if len(self._pending) - free >= self.max_queue:
                raise QueueFull(f"the queue of {self.model.name} is full ({self.max_queue} waiting requests)")
            self._pending.append(job)
            self._start()
            self._cv.notify()
        return job

    async def call(self, fn: Callable[[], Any]):
        """``fn()`` on the model's thread, between two steps of the batch; its value."""
        job = self.submit(Call(fn=fn, loop=asyncio.get_running_loop(), queue=asyncio.Queue()))
        return await job.result()

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
                    # rows join in order while there is room; a call runs whatever the batch's size, one between
                    # two steps of a running batch (a burst of them must not stall its rows), all when none runs
                    admit, waiting, room = [], deque(), self.max_batch - len(self._rows)
                    calls = 1 if self._rows else len(self._pending)
                    for job in self._pending:
                        if job.cancelled:
                            continue
                        is_call = isinstance(job, Call)
                        if (calls > 0) if is_call else (room > 0):
                            admit.append(job)
                            calls, room = calls - is_call, room - (not is_call)
                        else:
                            waiting.append(job)
                    self._pending = waiting
                joining = []
                for job in admit:
                    if job.cancelled:
                        continue
                    if not isinstance(job, Call):
                        joining.append(job)
                        continue
                    try:
                        job._emit(("done", job.fn()))
                    except Exception as e:
                        job._emit(("error", e))
                if joining:
                    self._admit_all(joining)
                try:
                    self._drop_finished()
                    if self._rows:
                        self._step()
                        self.steps += 1
                        self._drop_finished()
                except Exception as e:  # a bug or out of memory: fail the batch, keep serving
                    for job in self._rows:
                        job._emit(("error", e))
                    self._reset()
            for job in list(self._rows) + list(self._pending):
                job._emit(("error", RuntimeError("the server is shutting down")))
            self._reset()

    def _reset(self) -> None:
        self._rows = []

    def _admit_all(self, jobs: list[Job]) -> None:
        """The jobs that join at this step (one at a time unless an engine does better)."""
        for job in jobs:
            try:
                self._admit(job)
            except Exception as e:  # this request fails; the batch goes on
                job._emit(("error", e))

    def _admit(self, job: Job) -> None:
        raise NotImplementedError

    def _step(self) -> None:
        raise NotImplementedError

    def _drop_finished(self) -> None:
        raise NotImplementedError


def _splice(old: torch.Tensor, new: torch.Tensor, old_len: int, new_len: int, room: int) -> tuple[torch.Tensor, int]:
    """Stack two right-aligned caches (rows, kv, ·, hd) into one of ``max`` length (+ ``room`` free
    columns); the shorter one is left-padded with zeros (masked out by the caller)."""
    N = max(old_len, new_len)
    out = old.new_zeros(old.shape[0] + new.shape[0], old.shape[1], N + room, old.shape[3])
    out[: old.shape[0], :, N - old_len: N] = old[:, :, :old_len]
    out[old.shape[0]:, :, N - new_len: N] = new[:, :, :new_len]
    return out, N


def _or_none(mask: torch.Tensor) -> torch.Tensor | None:
    """A key mask, or None when every key is real (the model then takes its unmasked fast path)."""
    return None if bool(mask.all()) else mask


def _shift_left(t: torch.Tensor, by: int, n: int) -> None:
    """Move columns [by, n) of t (rows, kv, columns, hd) to [0, n - by), in place: in blocks of at most
    ``by`` columns, so no block's source and destination overlap."""
    for j in range(0, n - by, by):
        w = min(by, n - by - j)
        t[:, :, j:j + w] = t[:, :, j + by:j + by + w]


def _keep_rows(cache, mask: torch.Tensor, index: torch.Tensor, cross: bool = False) -> torch.Tensor:
    """Keep rows ``index`` of the batch cache and its key mask, and cut off the left the columns that
    have become padding in every row (their requests left): one copy (``DecoderCache.reorder``)."""
    mask = mask.index_select(0, index)
    first = int(mask.any(0).long().argmax())
    cache.reorder(index, cross=cross, start=first)
    return mask[:, first:]


class Engine(_EngineLoop):
    """Continuous batching over one ``DecoderOnly`` model (``LoadedModel`` of kind ``lm``)."""

    PREFIX_MIN = 16  # shared prefixes shorter than this are computed again (the copy is not worth it)

    def __init__(self, model, max_batch: int = 16, max_queue: int = 256, on_step=None, on_first_token=None,
                 compile: bool = False):
        super().__init__(model, max_batch, max_queue)
        # the one-token step may be compiled (``_served_step``); the prefill stays eager
        self.decode = _served_step(self.net, self.net, compile)
        self.eos_id = self.net.config.eos_id
        self.pad_id = self.net.config.pad_id
        self.on_step = on_step                 # callback(batch_size) after every decode step
        self.on_first_token = on_first_token   # callback(seconds from submit to first token)
        self._cache = None
        self._bufs: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer: the K and V buffers of the cache
        self._mask: torch.Tensor | None = None     # (rows, length) bool: real tokens
        self._last: torch.Tensor | None = None     # (rows,) newest token of each row
        self.largest_prefill = 0                   # most prompts prefilled in one forward so far
        self._prefix_tokens: list[int] | None = None  # the last prefilled prompt, and its K/V per layer
        self._prefix_kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.prefix_hits = 0                       # prompts whose first tokens came from it
        self.packed_prefills = 0                   # prefills that rode in a decoding step (forward_packed)
        self._warmed = False                       # warm_up ran (then the step never compiles again)

    def _reset(self) -> None:
        self._rows, self._cache, self._mask, self._last, self._bufs = [], None, None, None, []

    # the traffic of warm_up: waves of (prompt length, new tokens) that arrive together; the last
    # wave gets a newcomer after its first step (a prefill packed into a running batch, a spliced cache)
    # After the warm-up a batch no compiled graph fits runs eager instead of compiling (a minute during
    # which every row would wait; seen once in serve_load's third round before this): same answers to
    # float rounding, only that step is slower. (The tests set "fail_on_recompile": the warm-up must
    # cover the traffic they send.)
    after_warm_up = "eager_on_recompile"
    WARM_UP_WAVES = (((20, 3),), ((20, 5), (24, 3)), ((20, 4), (20, 4)), ((20, 6), (22, 6), (26, 6)))

    def warm_up(self) -> int:
        """Compile the decoding step before the first request (``--compile``): a compilation takes about a
        minute for SmolLM2 on 2 cores, and every row of a running batch would wait for each one. The
        step needs one graph per kind of batch it meets — one row (``accel.STREAMED_MAX_ROWS``), several
        rows, with and without a key mask (left padding) — so a few requests of made-up tokens go
        through the engine's own admission and steps, here on the caller's thread, before the engine
        thread starts; then everything they left behind is cleared. Returns the steps run (0: eager)."""
        if self.decode is self.net or self._thread is not None or self._warmed:
            return 0
        self._warmed = True
        vocab = self.net.config.vocab_size
        ids = [t for t in range(min(vocab, 64)) if t not in (self.eos_id, self.pad_id)]
        saved, steps = (self.eos_id, self.on_step, self.on_first_token), 0
        # made-up prompts must not stop early (every wave runs all its steps), nor count in the metrics
        self.eos_id = self.on_step = self.on_first_token = None
        def step():
            nonlocal steps
            self._step()
            steps += 1
            self._drop_finished()
        try:
            with torch.inference_mode():
                for w, wave in enumerate(self.WARM_UP_WAVES):
                    self._admit_all([Request(prompt=[ids[(w + i) % len(ids)]] * n, max_new_tokens=m)
                                     for i, (n, m) in enumerate(wave)])
                    if w == len(self.WARM_UP_WAVES) - 1:
                        step()
                        self._admit_all([Request(prompt=[ids[0]] * 21, max_new_tokens=3)])
                    while self._rows:
                        step()
        finally:
            self.eos_id, self.on_step, self.on_first_token = saved
            self._reset()
            self._prefix_tokens, self._prefix_kv = None, []
            self.steps = self.largest_prefill = self.prefix_hits = self.packed_prefills = 0
        compiled = self.decode

        def decode(*args, **kwargs):
            with torch.compiler.set_stance(self.after_warm_up):
                return compiled(*args, **kwargs)
        self.decode = decode
        return steps

    def _pick(self, req: Request, logits: torch.Tensor) -> int:
        """The next token of one row from its (1, V) logits: what ``stream_tokens`` does for it alone."""
        logits = req._process(logits, lambda: [req.generated], len(req.generated))
        if req._cfg.do_sample:
            logits = top_k_top_p(logits / req._cfg.temperature, req._cfg.top_k, req._cfg.top_p)
            return int(torch.multinomial(logits.softmax(-1), 1, generator=req._gen).item())
        return int(logits.argmax(-1).item())

    def _pick_or_fail(self, req: Request, logits: torch.Tensor) -> int:
        """:meth:`_pick`, or where this row's own options fail it, that row alone leaves with the error (the
        others' tokens are computed already; one request must not fail the batch). EOS stands in for its token."""
        try:
            return self._pick(req, logits)
        except Exception as e:
            req._emit(("error", e))
            req.cancelled = True
            return self.eos_id

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

    def _admit_all(self, reqs: list[Request]) -> None:
        """Prefill the newcomers together, then splice the rows that go on into the batch. With a batch
        running, the prefill rides in the batch's next decoding step (``DecoderOnly.forward_packed``:
        one pass over the weights for both) instead of stopping every row for a forward of its own.
        SmolLM2 fp32, 2 cores: a 16-row step ~65 ms, a one-prompt prefill ~50 ms (both mostly the
        weights' stream), the two packed ~100 ms (docs/results.md, "prefills inside the decoding step")."""
        ok = []
        for req in reqs:
            try:
                self._setup(req)
                ok.append(req)
            except Exception as e:
                req._emit(("error", e))
        if not ok:
            return
        packed = bool(self._rows) and hasattr(self.net, "forward_packed")
        started = False  # whether the running rows' caches have been touched
        try:
            x, mask, cache = self._prefill_inputs(ok)
            if packed:
                started = True
                self._make_room()
                step_mask = self._step_mask()
                running, logits = self.net.forward_packed([
                    (self._last[:, None], _or_none(step_mask), self._cache), (x, _or_none(mask), cache)])
                self._advance(step_mask, running.float())
                self.steps += 1
                self.packed_prefills += 1
            else:
                logits = self.net(x, _or_none(mask), cache=cache, last_only=True)
        except Exception as e:  # e.g. out of memory: these requests fail; a half-run packed step fails the batch
            for req in ok + (self._rows if started else []):
                req._emit(("error", e))
            if started:
                self._reset()
            return
        try:  # (the running rows are consistent here: only the newcomers fail)
            self._remember_prefix(ok[0].prompt, cache, mask[0])
            logits = logits.float()
            tokens = [self._pick_or_fail(r, logits[i: i + 1]) for i, r in enumerate(ok)]
        except Exception as e:
            for req in ok:
                req._emit(("error", e))
            return
        going = [i for i, (req, t) in enumerate(zip(ok, tokens)) if not req.cancelled and self._accept(req, t)]
        if not going:
            return
        if len(going) < len(ok):
            index = torch.tensor(going, device=mask.device)
            mask = _keep_rows(cache, mask, index)
        self._join([ok[i] for i in going], cache, mask, [tokens[i] for i in going])

    def _setup(self, req: Request) -> None:
        """A request's sampling state: what ``stream_tokens`` sets up for one prompt."""
        sample = req.temperature >= MIN_TEMPERATURE  # (below: greedy, as vLLM; sampling there would overflow)
        cfg = GenerationConfig(do_sample=sample, temperature=req.temperature if sample else 1.0, top_p=req.top_p,
                               seed=req.seed, max_new_tokens=req.max_new_tokens)
        cfg.validate()
        req._cfg = cfg
        dev = self.net.device
        req._gen = torch.Generator(device=dev).manual_seed(req.seed) if req.seed is not None else None
        if req._gen is None and cfg.do_sample:
            req._gen = torch.Generator(device=dev)
            req._gen.seed()
        req._process = LogitsProcessor(cfg, self.eos_id, [list(req.prompt)], self.pad_id)

    def _prefill_inputs(self, reqs: list[Request]):
        """The left-padded prompts of one prefill forward (a single prompt: no padding, exactly what
        ``generate`` runs) → ids (rows, S), key mask (rows, length) and the cache the forward fills,
        right-aligned. Positions count real tokens only, so a padded row computes what its prompt alone
        computes.

        **Prefix reuse**: the K/V of the last prefilled prompt are kept; when every newcomer starts with
        the same first ``c`` tokens as it (a chat template's system prompt, a shared instruction), those
        ``c`` columns are copied into the new cache instead of computed again, and only the rest of each
        prompt runs through the model. Causal attention makes this exact: a position's K/V depend on the
        tokens up to it only."""
        dev, n = self.net.device, len(reqs)
        c = self._reusable_prefix(reqs)
        rest = [r.prompt[c:] for r in reqs]
        S = max(len(t) for t in rest)
        x = torch.full((n, S), self.pad_id if self.pad_id is not None else 0, dtype=torch.long, device=dev)
        mask = torch.zeros(n, c + S, dtype=torch.bool, device=dev)
        mask[:, :c] = True
        for i, t in enumerate(rest):
            x[i, S - len(t):] = torch.tensor(t, device=dev)
            mask[i, c + S - len(t):] = True
        cache = self.net.new_cache(c + S + max(r.max_new_tokens for r in reqs) + 1)
        if c:
            for (layer, _), (k, v) in zip(cache.layers, self._prefix_kv):
                layer.append(k[:, :, :c].expand(n, -1, -1, -1), v[:, :, :c].expand(n, -1, -1, -1))
            self.prefix_hits += n
        self.largest_prefill = max(self.largest_prefill, n)
        return x, mask, cache

    def _reusable_prefix(self, reqs: list[Request]) -> int:
        """How many first tokens every newcomer shares with the kept prompt (0 below PREFIX_MIN; always
        leaving each prompt at least one token to compute, whose logits pick the first new token)."""
        if self._prefix_tokens is None:
            return 0
        kept, c = self._prefix_tokens, len(self._prefix_tokens)
        for r in reqs:
            limit = min(c, len(r.prompt) - 1)
            same = 0
            while same < limit and r.prompt[same] == kept[same]:
                same += 1
            c = same
        return c if c >= self.PREFIX_MIN else 0

    def _remember_prefix(self, prompt: list[int], cache, real: torch.Tensor) -> None:
        """Keep one prompt's K/V (its real columns, in order) for the next prefill."""
        if len(prompt) < self.PREFIX_MIN:
            return
        cols = real.nonzero().squeeze(1)
        self._prefix_kv = [(layer.k[:1].index_select(2, cols), layer.v[:1].index_select(2, cols))
                           for layer, _ in cache.layers]
        self._prefix_tokens = list(prompt)

    def _join(self, reqs: list[Request], cache, mask: torch.Tensor, tokens: list[int]) -> None:
        """Splice prefilled rows (their right-aligned cache and key mask) into the batch cache. Newcomers
        no longer than the batch are written into the buffers' free rows (``_rebuild``): the join copies
        their K/V only. Otherwise the buffers are made again, every row copied."""
        dev = self.net.device
        new_last = torch.tensor(tokens, device=dev)
        B, n, P = len(self._rows), len(reqs), cache.length
        L = self._cache.length if B else 0
        if not (B and P <= L and self._buffers_hold(B + n, L + 1)):
            self._rebuild(B + n, max(L, P), like=cache)
            L = self._cache.length
        for (bc, _), (nc, _), (kb, vb) in zip(self._cache.layers, cache.layers, self._bufs):
            for buf, new in ((kb, nc.k), (vb, nc.v)):
                buf[B:B + n, :, :L - P].zero_()  # left padding: masked out, but finite (0 × NaN is NaN)
                buf[B:B + n, :, L - P:L] = new[:, :, :P]
            bc.k, bc.v = kb[:B + n], vb[:B + n]
        joined = torch.zeros(B + n, L, dtype=torch.bool, device=dev)
        if B:
            joined[:B] = self._mask
            self._last = torch.cat([self._last, new_last])
        else:
            self._last = new_last
        joined[B:, L - P:] = mask
        self._mask = joined
        self._rows.extend(reqs)

    # The batch cache lives in buffers of (up to max_batch rows, kv, columns, hd) per layer, and each layer's
    # KVCache holds a view of their first rows (contiguous, as a cache of exactly those rows would be, so a
    # compiled step sees the same layout). Joining, leaving and cutting padding columns then move only the
    # rows and columns that change, in place: with fresh buffers per change (the first engine), a join of
    # SmolLM2 at 16 rows took ~30 ms, most of it the kernel's page faults on ~8 MB of new memory per tensor
    # (docs/results.md, "the batch cache in place").
    ROOM = 64     # free columns a rebuilt cache keeps for the coming steps
    CUT_MIN = 16  # all-padding columns on the left are cut (shifted out in place) once there are this many

    def _buffers_hold(self, rows: int, cols: int) -> bool:
        """Whether the buffers have ``rows`` rows and ``cols`` columns, and the cache still lives in them
        (a step that outgrew the columns has its KVCache reallocate on its own)."""
        return bool(self._bufs) and self._bufs[0][0].shape[0] >= rows and self._bufs[0][0].shape[2] >= cols and all(
            bc.k.data_ptr() == kb.data_ptr() for (bc, _), (kb, _) in zip(self._cache.layers, self._bufs))

    def _rebuild(self, rows: int, N: int, like) -> None:
        """New buffers of at least ``rows`` rows and N + ROOM columns, the running rows' K/V copied
        right-aligned to length N (their new left padding zeroed, as their mask); ``like`` (a cache of the
        same model) gives the shapes when no row is running."""
        B = len(self._rows)
        L = self._cache.length if B else 0
        # rows for the next newcomers too, as a vector grows (twice the rows, at least 8), up to max_batch:
        # untouched rows cost no memory on CPU, but a GPU allocation is memory taken
        cap = max(rows, min(self.max_batch, max(2 * rows, 8)))
        bufs = []
        for i, (nc, _) in enumerate(like.layers):
            pair = []
            for name in ("k", "v"):
                t = getattr(nc, name)
                buf = t.new_empty(cap, t.shape[1], N + self.ROOM, t.shape[3])
                if B:
                    buf[:B, :, :N - L].zero_()
                    buf[:B, :, N - L:N] = getattr(self._cache.layers[i][0], name)[:, :, :L]
                pair.append(buf)
            bufs.append(tuple(pair))
        if not B:
            self._cache = self.net.new_cache()
        for (bc, _), (kb, vb) in zip(self._cache.layers, bufs):
            bc.k, bc.v, bc.length = kb[:B], vb[:B], N
        if B and N > L:
            self._mask = torch.cat([self._mask.new_zeros(B, N - L), self._mask], 1)
        self._bufs = bufs

    def _make_room(self) -> None:
        """A free column for the token the next step appends (the buffers grow by ROOM columns), in buffers
        the cache lives in."""
        if self._rows and not self._buffers_hold(len(self._rows), self._cache.length + 1):
            self._rebuild(len(self._rows), self._cache.length, like=self._cache)

    def _step(self) -> None:
        """One token for every row of the batch."""
        self._make_room()
        mask = self._step_mask()
        self._advance(mask, self.decode(self._last[:, None], _or_none(mask), cache=self._cache,
                                        last_only=True).float())

    def _step_mask(self) -> torch.Tensor:
        """The batch's key mask with the column of the token this step feeds."""
        return torch.cat([self._mask, self._mask.new_ones(len(self._rows), 1)], 1)

    def _advance(self, mask: torch.Tensor, logits: torch.Tensor) -> None:
        """Each row's next token from the step's (rows, V) logits; finished rows are marked to leave."""
        B = len(self._rows)
        self._mask = mask
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
            t = self.eos_id if req.cancelled else greedy[i] if i in greedy else self._pick_or_fail(req, logits[i: i + 1])
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
        dev = self._last.device
        if not self._buffers_hold(len(self._rows), 0):  # the cache left its buffers (an append outgrew them)
            self._rebuild(len(self._rows), self._cache.length, like=self._cache)
        # the last rows that stay move into the holes below them: one row copied per hole
        B = len(keep)
        holes = [i for i in range(B) if self._rows[i].cancelled]
        movers = [i for i in keep if i >= B]
        order = list(range(B))
        for h, m in zip(holes, movers):
            order[h] = m
        N = self._cache.length
        if holes:
            dst, src = torch.tensor(holes, device=dev), torch.tensor(movers, device=dev)
            for kb, vb in self._bufs:
                kb[dst, :, :N] = kb[src, :, :N]
                vb[dst, :, :N] = vb[src, :, :N]
        index = torch.tensor(order, device=dev)
        mask = self._mask.index_select(0, index)
        self._last = self._last.index_select(0, index)
        self._rows = [self._rows[i] for i in order]
        first = int(mask.any(0).long().argmax())  # columns that are padding in every row (their requests left)
        if first >= self.CUT_MIN:
            for kb, vb in self._bufs:
                _shift_left(kb[:B], first, N)
                _shift_left(vb[:B], first, N)
            mask, N = mask[:, first:], N - first
        self._mask = mask
        for (bc, _), (kb, vb) in zip(self._cache.layers, self._bufs):
            bc.k, bc.v, bc.length = kb[:B], vb[:B], N


class TranslationEngine(_EngineLoop):
    """Continuous batching of beam search over one ``EncoderDecoder`` (``LoadedModel`` of kind
    ``translation``).

    A request is encoded alone (as ``translate`` encodes one sentence); its cross-attention K/V are
    projected once and repeated for its K beams; its K rows then join the shared decoder batch with
    an empty target history. The batch's self-attention cache is right-aligned exactly as in
    :class:`Engine` (target positions count real tokens, so a row that joined late computes what it
    computes alone); the cross-attention K/V of rows with shorter sources are right-padded, with a
    source mask per row. Every step runs the decoder once for all rows; each request's ``BeamSearch``
    then picks its K continuations from its own K rows (greedy is K = 1), and one ``reorder`` applies
    every request's choice, dropping the requests that finished. ``max_batch`` counts requests."""

    def __init__(self, model, max_batch: int = 16, max_queue: int = 256, on_step=None, compile: bool = False):
        super().__init__(model, max_batch, max_queue)
        # The decoder step stays eager under ``serve --compile``: its batches change kind far more than a
        # language model's (the first step's empty cache, beams joining and reordering, source masks,
        # the cache's capacity), and no warm-up covers them at an affordable cost. Measured: a one-layer
        # translator met 18 graphs over five waves of mixed requests and hit dynamo's recompile limit;
        # a compilation of generation_speed.py's Marian-size decoder takes ~17–24 s on 2 cores, every row waiting.
        # ``attnlab translate --compile`` is where translators compile.
        if compile:
            log.info("serve --compile: %s is a translator, its decoding step stays eager", type(self.net).__name__)
        self.decode = self.net.decode
        cfg = self.net.config
        self.eos_id, self.pad_id, self.bos_id = cfg.eos_id, cfg.pad_id, cfg.bos_id
        self.on_step = on_step
        self._cache = None
        self._mask: torch.Tensor | None = None      # (rows, target length) bool
        self._src_mask: torch.Tensor | None = None  # (rows, source length) bool
        self._last: torch.Tensor | None = None      # (rows,)

    def _reset(self) -> None:
        self._rows, self._cache, self._mask, self._src_mask, self._last = [], None, None, None, None

    def _admit(self, job: TranslationJob) -> None:
        net, dev, K = self.net, self.net.device, job.cfg.num_beams
        # as ``generate``: the source length + 50, never past learned positions (a larger ask fails this job alone)
        job.cfg.max_new_tokens = translation_budget(net, len(job.src), job.cfg)
        memory = net.encode(torch.tensor([job.src], device=dev))
        cache = net.new_cache()
        for layer, (_, cross) in zip(net.decoder.layers, cache.layers):
            k, v = layer.cross_attn.project_memory(memory)
            cross.set(k.repeat_interleave(K, 0), v.repeat_interleave(K, 0))
        job.search = BeamSearch(1, job.cfg, self.eos_id, job.cfg.max_new_tokens, None, self.pad_id, dev)
        S = len(job.src)
        last = torch.full((K,), self.bos_id, dtype=torch.long, device=dev)
        if not self._rows:
            self._rows, self._cache, self._last = [job], cache, last
            self._mask = torch.ones(K, 0, dtype=torch.bool, device=dev)
            self._src_mask = torch.ones(K, S, dtype=torch.bool, device=dev)
            return
        R, L, S0 = self._last.shape[0], self._cache.length, self._src_mask.shape[1]
        for (bs, bx), (_, nx) in zip(self._cache.layers, cache.layers):
            if bs.k is not None:  # the newcomer has no target history yet: zero columns, masked out
                none = bs.k.new_empty(K, bs.k.shape[1], 0, bs.k.shape[3])
                bs.k, _ = _splice(bs.k, none, L, 0, 64)
                bs.v, _ = _splice(bs.v, none, L, 0, 64)
            S2 = max(S0, S)
            k = bx.k.new_zeros(R + K, bx.k.shape[1], S2, bx.k.shape[3])  # sources right-padded
            v = torch.zeros_like(k)
            k[:R, :, :S0], v[:R, :, :S0] = bx.k, bx.v
            k[R:, :, :S], v[R:, :, :S] = nx.k, nx.v
            bx.set(k, v)
        mask = torch.zeros(R + K, L, dtype=torch.bool, device=dev)
        mask[:R] = self._mask
        src_mask = torch.zeros(R + K, max(S0, S), dtype=torch.bool, device=dev)
        src_mask[:R, :S0] = self._src_mask
        src_mask[R:, :S] = True
        self._mask, self._src_mask = mask, src_mask
        self._last = torch.cat([self._last, last])
        self._rows.append(job)

    def _step(self) -> None:
        R = self._last.shape[0]
        mask = torch.cat([self._mask, self._mask.new_ones(R, 1)], 1)
        logits = self.decode(self._last[:, None], None, _or_none(self._src_mask), _or_none(mask),
                             cache=self._cache, last_only=True).float()
        self._mask = mask
        if self.on_step:
            self.on_step(len(self._rows))
        index, tokens, offset, dropped = [], [], 0, False
        for job in self._rows:
            K = job.cfg.num_beams
            step = None if job.cancelled else job.search.advance(logits[offset: offset + K])
            if step is None:
                if not job.cancelled:
                    job._emit(("done", job.search.results()[0]))
                job.cancelled, dropped = True, True
            else:
                rows, tok = step
                index.append(rows + offset)
                tokens.append(tok)
            offset += K
        if not index:
            self._reset()
            return
        index = torch.cat(index)
        if dropped or not torch.equal(index, torch.arange(R, device=index.device)):
            # beams move within their request (cross K/V stay); a finished request's rows leave
            self._mask = _keep_rows(self._cache, self._mask, index, cross=dropped)
            if dropped:
                self._src_mask = self._src_mask.index_select(0, index)
        self._last = torch.cat(tokens)
        if dropped:
            self._rows = [j for j in self._rows if not j.cancelled]

    def _drop_finished(self) -> None:
        """Requests whose caller left before a step dropped them: drop them now."""
        if not any(j.cancelled for j in self._rows):
            return
        index, offset, keep = [], 0, []
        for job in self._rows:
            K = job.cfg.num_beams
            if not job.cancelled:
                index.append(torch.arange(offset, offset + K))
                keep.append(job)
            offset += K
        if not keep:
            self._reset()
            return
        index = torch.cat(index).to(self._last.device)
        self._mask = _keep_rows(self._cache, self._mask, index, cross=True)
        self._src_mask = self._src_mask.index_select(0, index)
        self._last = self._last.index_select(0, index)
        self._rows = keep


class BatchEngine(_EngineLoop):
    """Encoders (embeddings, classification): the requests waiting when the model is free are run
    together, one call of their function over all their inputs (the function batches by length
    itself). ``max_batch`` counts requests."""

    def __init__(self, model, max_batch: int = 64, max_queue: int = 256, on_step=None):
        super().__init__(model, max_batch, max_queue)
        self.on_step = on_step

    def _admit(self, job: Batch) -> None:
        self._rows.append(job)

    def _step(self) -> None:
        jobs, self._rows = self._rows, []
        if self.on_step:
            self.on_step(len(jobs))
        for fn in dict.fromkeys(j.fn for j in jobs):  # embed and classify requests: one call each
            group = [j for j in jobs if j.fn == fn]
            try:
                out = fn([x for j in group for x in j.inputs])
            except Exception as e:
                for j in group:
                    j._emit(("error", e))
                continue
            start = 0
            for j in group:
                j._emit(("done", out[start: start + len(j.inputs)]))
                start += len(j.inputs)

    def _drop_finished(self) -> None:
        self._rows = [j for j in self._rows if not j.cancelled]
