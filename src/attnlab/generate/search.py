"""Autoregressive generation for every family: greedy, sampling, beam search — all on the KV cache.

One *stepper* per family hides how a model turns "the tokens so far" into next-token logits
(encoder-decoder: encode once, decoder steps with self- and cross-attention caches; decoder-only:
prefill the left-padded prompt, then one token per step). The search algorithms only see
``stepper.step(tokens) -> logits`` and ``stepper.select(rows)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import torch

from ..accel import accelerate_for_inference, compiled_step
from ..model.transformer import DecoderOnly, EncoderDecoder, eval_mode
from .processors import LogitsProcessor, top_k_top_p


def top_k_of_rows(x: torch.Tensor, k: int, chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """``x.topk(k, dim=-1)`` of a (rows, V) tensor, for a small ``k`` and a long V (a beam's 2K best tokens
    of a vocabulary). The k largest values of a row lie in the k chunks (of ``chunk`` columns) with the
    largest maxima — a value outside them would have k chunk maxima, k distinct values, above it — so
    only those k·chunk candidates (and the columns after the last whole chunk) are ranked. Same values
    as ``topk``, best first; among exactly equal values the index taken may differ, as it may between
    ``topk`` implementations. Why: PyTorch's CPU ``topk`` over 256 × 8,000 logits took 1.4 ms, about 5%
    of a Marian beam step; the chunk maxima are one cheap pass."""
    R, V = x.shape
    n = V // chunk
    if n <= 2 * k:
        return x.topk(k, dim=-1)
    body = x[:, :n * chunk].view(R, n, chunk)                                    # (R, n, chunk), a view
    blocks = body.amax(-1).topk(k, dim=-1).indices                              # (R, k) chunk numbers
    rows = (blocks + torch.arange(R, device=x.device)[:, None] * n).view(-1)
    cand = body.reshape(R * n, chunk).index_select(0, rows).view(R, k * chunk)
    cols = (blocks[..., None] * chunk + torch.arange(chunk, device=x.device)).view(R, k * chunk)
    if n * chunk < V:
        cand = torch.cat([cand, x[:, n * chunk:]], 1)
        cols = torch.cat([cols, torch.arange(n * chunk, V, device=x.device).expand(R, -1)], 1)
    values, j = cand.topk(k, dim=-1)
    return values, cols.gather(1, j)


def log_softmax_(x: torch.Tensor) -> torch.Tensor:
    """``x.log_softmax(-1)`` written over ``x`` (a step's logits, which nothing reads afterwards).
    Why: a new (rows, V) output is megabytes of fresh pages at every step — 256 × 8,000 fp32 logits of a
    beam-4 Marian batch are 8 MB — and writing them back where they were read is about twice as fast
    (ad-hoc timing, capped at AVX2: 1.0 vs 2.1 ms alone, 5 ms per step inside the beam loop's profile).
    PyTorch's kernel finishes reading a row before it writes it; where ``out=x`` is refused (a
    non-contiguous ``x``, a kernel that checks for overlap), a new tensor."""
    if x.is_contiguous():
        try:
            return torch.log_softmax(x, -1, out=x)
        except RuntimeError:
            pass
    return x.log_softmax(-1)


# Sampling below this temperature is greedy decoding in all but rounding (vLLM draws the same line; attnlab serve maps
# such a request to greedy), and logits / temperature overflow float32 near 1e-37: GenerationConfig refuses it.
MIN_TEMPERATURE = 1e-5


@dataclass
class GenerationConfig:
    max_new_tokens: int | None = None  # None: source length + 50 (translation), 128 (LM)
    min_new_tokens: int = 0
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    no_repeat_ngram_size: int = 0
    num_beams: int = 1
    length_penalty: float = 0.6  # GNMT α; the paper uses 0.6 with beam 4
    early_stopping: bool = True
    num_return_sequences: int = 1
    seed: int | None = None
    compile: bool = False  # torch.compile the one-token decode step (weights frozen in; see compiled_step)

    def validate(self) -> None:
        if self.num_beams < 1:
            raise ValueError(f"num_beams={self.num_beams} must be >= 1")
        if self.num_return_sequences > self.num_beams and not self.do_sample:
            raise ValueError(f"num_return_sequences={self.num_return_sequences} > num_beams={self.num_beams}")
        if self.temperature < MIN_TEMPERATURE and self.do_sample:
            raise ValueError(f"temperature={self.temperature} is below {MIN_TEMPERATURE} while sampling: that samples "
                             f"the argmax (and under ~1e-37 the scaled logits overflow); decode greedily instead")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty={self.repetition_penalty} must be > 0")


@dataclass
class Hypothesis:
    tokens: list[int]
    score: float  # sum of log-probabilities (beam: divided by the length penalty)
    logprob: float = 0.0


@dataclass
class GenerationOutput:
    sequences: list[list[int]]  # best hypothesis per input (generated tokens only, no EOS)
    nbest: list[list[Hypothesis]] = field(default_factory=list)


# -- steppers ---------------------------------------------------------------------------------------

class Seq2SeqStepper:
    """Encoder-decoder: the encoder runs once; cross-attention K/V are computed at the first step
    and cached; each step feeds only the newest target token."""

    def __init__(self, model: EncoderDecoder, src: torch.Tensor, src_mask: torch.Tensor | None,
                 expand: int = 1, capacity: int = 0, compile: bool = False):
        if src_mask is not None and src_mask.all():
            src_mask = None  # no padding: skip masking work at every step
        memory = model.encode(src, src_mask)
        self.cache = model.new_cache(capacity)  # a static cache: sized once, never regrown
        if expand > 1:
            # Beams of one source share its encoder output: project cross-attention K/V once per
            # source, then repeat them for the beams (one copy at the start, never per step).
            for layer, (_, cross) in zip(model.decoder.layers, self.cache.layers):
                k, v = layer.cross_attn.project_memory(memory)
                cross.set(k.repeat_interleave(expand, 0), v.repeat_interleave(expand, 0))
            memory = None
            src_mask = src_mask.repeat_interleave(expand, 0) if src_mask is not None else None
        self.model, self.memory, self.src_mask = model, memory, src_mask
        self.decode = compiled_step(model, model.decode) if compile else model.decode
        self.first = True

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, 1) → next-token logits (B, V)."""
        decode = self.model.decode if self.first else self.decode  # the first step fills the cross K/V
        self.first = False
        return decode(tokens, self.memory, self.src_mask, cache=self.cache, last_only=True).float()

    def select(self, rows: torch.Tensor, within_groups: bool = False) -> None:
        self.cache.reorder(rows, cross=not within_groups)
        if not within_groups and self.memory is not None:
            self.memory = self.memory.index_select(0, rows)
            self.src_mask = self.src_mask.index_select(0, rows) if self.src_mask is not None else None


class DecoderOnlyStepper:
    """Decoder-only: the (left-padded) prompt is prefilled in one pass; then one token per step.
    The attention mask grows with the sequence so left padding stays invisible."""

    def __init__(self, model: DecoderOnly, prompt: torch.Tensor, prompt_mask: torch.Tensor | None,
                 expand: int = 1, capacity: int = 0, compile: bool = False):
        if expand > 1:
            prompt = prompt.repeat_interleave(expand, 0)
            prompt_mask = prompt_mask.repeat_interleave(expand, 0) if prompt_mask is not None else None
        self.model, self.prompt = model, prompt
        self.mask = prompt_mask if prompt_mask is not None and not prompt_mask.all() else None
        self.cache = model.new_cache(capacity)
        self.decode = compiled_step(model, model) if compile else model  # prefill stays eager
        self.first = True

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.first:
            self.first = False
            return self.model(self.prompt, self.mask, cache=self.cache, last_only=True).float()
        if self.mask is not None:
            self.mask = torch.cat([self.mask, self.mask.new_ones(self.mask.shape[0], 1)], 1)
        return self.decode(tokens, self.mask, cache=self.cache, last_only=True).float()

    def select(self, rows: torch.Tensor, within_groups: bool = False) -> None:
        self.cache.reorder(rows)
        if self.mask is not None:
            self.mask = self.mask.index_select(0, rows)


# -- greedy and sampling ------------------------------------------------------------------------------


def stream_tokens(stepper, batch_size: int, start: torch.Tensor | None, cfg: GenerationConfig,
                  eos_id: int, max_new_tokens: int | list[int], prompts: list[list[int]] | None = None,
                  pad_id: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Greedy or sampled decoding; yields (row indices, new tokens) after every step. ``max_new_tokens``: one
    budget for every row, or a list of each row's own (a translation's: its own source length + 50).

    Finished rows (EOS, or their budget spent) leave the batch: their cache rows are dropped so they stop
    costing work.
    """
    device = start.device if start is not None else stepper.prompt.device
    budgets = torch.tensor(max_new_tokens, device=device) if isinstance(max_new_tokens, list) else None
    gen = torch.Generator(device=device).manual_seed(cfg.seed) if cfg.seed is not None else None
    process = LogitsProcessor(cfg, eos_id, prompts, pad_id)
    active = torch.arange(batch_size, device=device)  # original row of each live row
    generated: list[list[int]] = [[] for _ in range(batch_size)]
    tokens = start
    for step in range(int(budgets.max()) if budgets is not None else max_new_tokens):
        logits = stepper.step(tokens)  # (live, V)
        if process.needs_history and prompts is not None:
            process.prompts = [prompts[i] for i in active.tolist()]
        logits = process(logits, lambda: [generated[i] for i in active.tolist()], step)
        if cfg.do_sample:
            logits = top_k_top_p(logits / cfg.temperature, cfg.top_k, cfg.top_p)
            nxt = torch.multinomial(logits.softmax(-1), 1, generator=gen).squeeze(1)
        else:
            nxt = logits.argmax(-1)
        for r, t in zip(active.tolist(), nxt.tolist()):
            generated[r].append(t)
        yield active, nxt
        done = nxt == eos_id
        if budgets is not None:
            done |= budgets[active] <= step + 1
        if done.all():
            return
        if done.any():
            keep = (~done).nonzero().squeeze(1)
            stepper.select(keep)
            active, nxt = active[keep], nxt[keep]
        tokens = nxt[:, None]


# -- beam search --------------------------------------------------------------------------------------


def length_penalty(length: int, alpha: float) -> float:
    """GNMT (Wu et al. 2016): ((5 + |Y|) / 6)^α. α = 0 is the plain sum of log-probabilities."""
    return ((5.0 + length) / 6.0) ** alpha


def beam_search(stepper, batch_size: int, start: torch.Tensor, cfg: GenerationConfig, eos_id: int,
                max_new_tokens: int | list[int], prompts: list[list[int]] | None = None,
                pad_id: int | None = None) -> list[list[Hypothesis]]:
    """Batched beam search (B·K rows). Returns, per input, the finished hypotheses sorted by
    length-normalised score (best first)."""
    search = BeamSearch(batch_size, cfg, eos_id, max_new_tokens, prompts, pad_id, start.device)
    tokens = start
    while True:
        step = search.advance(stepper.step(tokens))  # (B·K, V) logits in
        if step is None:
            return search.results()
        rows, new_tok = step
        stepper.select(rows, within_groups=True)
        tokens = new_tok[:, None]


class BeamSearch:
    """The state of a beam search over B inputs × K beams, one ``advance`` per decoding step. Each
    step takes the 2K best continuations of every input, finishes those that end in EOS, and keeps
    the K best others alive. ``beam_search`` drives it for one batch; ``attnlab serve`` drives one
    per request inside its shared decoding batch."""

    def __init__(self, batch_size: int, cfg: GenerationConfig, eos_id: int, max_new_tokens: int | list[int],
                 prompts: list[list[int]] | None = None, pad_id: int | None = None, device=None):
        K, B = cfg.num_beams, batch_size
        self.cfg, self.eos_id, self.B, self.K = cfg, eos_id, B, K
        # each input's budget of new tokens (one for all, or a list: a translation's own source length + 50)
        self.budgets = list(max_new_tokens) if isinstance(max_new_tokens, list) else [max_new_tokens] * B
        self.process = LogitsProcessor(cfg, eos_id, [p for p in prompts for _ in range(K)] if prompts else None,
                                       pad_id)
        self.scores = torch.full((B, K), float("-inf"), device=device)
        self.scores[:, 0] = 0.0  # all beams start identical: only one may expand at the first step
        self.seqs = torch.zeros(B * K, 0, dtype=torch.long, device=device)
        self.finished: list[list[Hypothesis]] = [[] for _ in range(B)]
        self.done = [False] * B
        self.step = 0

    def advance(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Next-token logits (B·K, V) → (rows each beam continues, (B·K,) its new token), or None when
        every input's search is over (then read ``results``)."""
        cfg, K, B, step, device = self.cfg, self.K, self.B, self.step, self.scores.device
        logits = self.process(logits, self.seqs.tolist, step)
        # The group's 2K best continuations are among each beam's own 2K best tokens (a beam adds the
        # same score to all its tokens), so only those are ranked: no (B·K, V) sum of scores, no top-2K
        # over K·V. (log_softmax, one fused pass, is ~2.5× faster on CPU than ``best - logsumexp``, which
        # PyTorch computes in four: 256 × 8,000 logits, 0.67 vs 1.69 ms.)
        W = min(2 * K, logits.shape[-1])
        logp, best_tok = top_k_of_rows(log_softmax_(logits.float()), W)           # (B·K, W) each
        cand = (self.scores.view(B * K, 1) + logp).view(B, K * W)
        top, idx = cand.topk(2 * K, dim=1)  # (B, 2K)
        beam, tok = idx // W, best_tok.view(B, K * W).gather(1, idx)
        is_eos = tok == self.eos_id
        last = [step == n - 1 for n in self.budgets]  # the inputs at their length limit
        # Finish EOS candidates ranked within the top K; at an input's length limit, the top K of all.
        finish = is_eos[:, :K] if not any(last) else is_eos[:, :K] | torch.tensor(last, device=device)[:, None]
        for b, j in finish.nonzero().tolist():
            if not self.done[b] and top[b, j] != float("-inf"):
                self.finished[b].append(_hypothesis(self.seqs[b * K + beam[b, j].item()].tolist(), tok[b, j].item(),
                                                    bool(is_eos[b, j]), top[b, j].item(), cfg.length_penalty))
        # K best non-EOS candidates stay alive (rank order preserved).
        rank = torch.arange(2 * K, device=device).expand(B, 2 * K) + is_eos.long() * (2 * K)
        keep = rank.topk(K, dim=1, largest=False).indices  # (B, K)
        new_scores = top.gather(1, keep).masked_fill(is_eos.gather(1, keep), float("-inf"))
        rows = (beam.gather(1, keep) + torch.arange(B, device=device)[:, None] * K).view(-1)
        new_tok = tok.gather(1, keep).view(-1)
        for b in range(B):
            self.done[b] = self.done[b] or step >= self.budgets[b] - 1 or _group_done(
                self.finished[b], new_scores[b].max().item(), cfg, step, self.budgets[b])
        if all(self.done):
            return None
        self.scores = new_scores.masked_fill(torch.tensor(self.done, device=device)[:, None], float("-inf"))
        self.seqs = torch.cat([self.seqs.index_select(0, rows), new_tok[:, None]], 1)
        self.step += 1
        return rows, new_tok

    def results(self) -> list[list[Hypothesis]]:
        """Per input, the finished hypotheses, best first (out of length: alive beams count as finished)."""
        K = self.K
        for b in range(self.B):
            if len(self.finished[b]) < K:
                self.finished[b] += [_hypothesis(self.seqs[b * K + k].tolist(), None, False, self.scores[b, k].item(),
                                                 self.cfg.length_penalty)
                                     for k in range(K) if self.scores[b, k] > float("-inf")]
            self.finished[b].sort(key=lambda h: -h.score)
        return self.finished


def _hypothesis(prefix: list[int], token: int | None, eos: bool, logprob: float, alpha: float) -> Hypothesis:
    """A finished hypothesis: the prefix plus its last token (EOS is not kept, but counts in the length)."""
    tokens = prefix if eos or token is None else prefix + [token]
    return Hypothesis(tokens, logprob / length_penalty(len(tokens) + eos, alpha), logprob)


def _group_done(finished: list[Hypothesis], best_alive: float, cfg: GenerationConfig, step: int,
                max_new_tokens: int) -> bool:
    """Whether an input's search is over: K hypotheses finished and (early stopping, or) no alive beam
    can still beat the worst of them."""
    K = cfg.num_beams
    if len(finished) < K:
        return False
    worst = min(h.score for h in sorted(finished, key=lambda h: -h.score)[:K])
    # With α > 0 a longer hypothesis can still gain; bound its best possible score.
    bound = best_alive / length_penalty(max_new_tokens if cfg.length_penalty > 0 else step + 1,
                                        cfg.length_penalty) if best_alive < 0 else best_alive
    return cfg.early_stopping or bound <= worst


# -- entry points -------------------------------------------------------------------------------------


def lm_budget(model, prompt_len: int, cfg: GenerationConfig) -> int:
    """New tokens for a decoder-only prompt: ``max_new_tokens`` (default 128), and never past the
    last position the model has (learned positions stop at ``max_len``; a prompt that already fills
    the context is an error, as in Hugging Face)."""
    mcfg = model.config
    max_new = cfg.max_new_tokens or 128
    if mcfg.positions == "learned":
        if prompt_len >= mcfg.max_len:
            raise ValueError(f"the prompt is {prompt_len} tokens but the model has a context of {mcfg.max_len} "
                             f"positions (learned positions), leaving no room to generate: shorten it to at most "
                             f"{mcfg.max_len - 1} tokens")
        max_new = min(max_new, mcfg.max_len - prompt_len)
    return max_new


def translation_budget(model, source_len: int, cfg: GenerationConfig) -> int:
    """New target tokens for one source of ``source_len`` tokens: ``max_new_tokens``, by default the source length
    + 50, and never past the decoder's learned position table (the start token sits at position 0, the n-th new
    token is fed at n - 1, so at most ``max_len`` new tokens; the default is cut there, a larger request refused)."""
    mcfg = model.config
    max_new = cfg.max_new_tokens or source_len + 50
    if mcfg.positions == "learned" and max_new > mcfg.max_len:
        if cfg.max_new_tokens:
            raise ValueError(f"max_new_tokens={cfg.max_new_tokens} is past the decoder's learned position table "
                             f"(max_len={mcfg.max_len}): ask for at most {mcfg.max_len} new tokens")
        max_new = mcfg.max_len
    return max_new


@torch.inference_mode()
def stream(model, prompt_ids: list[int], config: GenerationConfig | None = None, **overrides) -> Iterator[int]:
    """Greedy or sampled decoding of one decoder-only prompt, yielding each new token id as soon as it
    exists (EOS ends the stream and is not yielded). The same tokens as ``generate`` on that prompt."""
    cfg = config or GenerationConfig()
    if overrides:
        cfg = GenerationConfig(**{**cfg.__dict__, **overrides})
    cfg.validate()
    if cfg.num_beams > 1 and not cfg.do_sample:
        raise ValueError("streaming is greedy or sampled decoding; beam search (num_beams > 1) cannot stream")
    if not isinstance(model, DecoderOnly):
        raise TypeError(f"streaming needs a decoder-only model, got {type(model).__name__}")
    accelerate_for_inference(model)
    with eval_mode(model):
        x = torch.tensor([prompt_ids], device=model.device)
        max_new = lm_budget(model, x.shape[1], cfg)
        stepper = DecoderOnlyStepper(model, x, None, capacity=x.shape[1] + max_new + 1, compile=cfg.compile)
        eos = model.config.eos_id
        for _, t in stream_tokens(stepper, 1, None, cfg, eos, max_new, [list(prompt_ids)], model.config.pad_id):
            if t.item() == eos:
                return
            yield t.item()


@torch.inference_mode()  # cheaper than no_grad: no version counters, no view tracking
def generate(model, inputs: torch.Tensor, input_mask: torch.Tensor | None = None,
             config: GenerationConfig | None = None, **overrides) -> GenerationOutput:
    """Generate for a batch.

    * encoder-decoder: ``inputs`` are source ids (B, S) with ``input_mask`` (True = token);
      the decoder starts from BOS. Default max length: each source's own length + 50 (the paper).
    * decoder-only: ``inputs`` are **left-padded** prompts (B, T) with ``input_mask``.
    Returns the generated tokens (without EOS) per input, and the n-best lists for beam search.
    """
    cfg = config or GenerationConfig()
    if overrides:
        cfg = GenerationConfig(**{**cfg.__dict__, **overrides})
    cfg.validate()
    accelerate_for_inference(model)  # pre-packed CPU linears where this CPU can (same results)
    mcfg, B = model.config, inputs.shape[0]
    with eval_mode(model):
        stepper, start, prompts, max_new = _start(model, inputs, input_mask, cfg)
        if cfg.num_beams == 1 or cfg.do_sample:
            seqs = [[] for _ in range(B)]
            for rows, toks in stream_tokens(stepper, B, start, cfg, mcfg.eos_id, max_new, prompts, mcfg.pad_id):
                for r, t in zip(rows.tolist(), toks.tolist()):
                    seqs[r].append(t)
            seqs = [s[: s.index(mcfg.eos_id)] if mcfg.eos_id in s else s for s in seqs]
            return GenerationOutput(seqs, [[Hypothesis(s, 0.0)] for s in seqs])
        nbest = beam_search(stepper, B, start, cfg, mcfg.eos_id, max_new, prompts, mcfg.pad_id)
    nbest = [h[: cfg.num_return_sequences] if cfg.num_return_sequences > 1 else h for h in nbest]
    return GenerationOutput([h[0].tokens for h in nbest], nbest)


def _start(model, inputs: torch.Tensor, input_mask: torch.Tensor | None, cfg: GenerationConfig):
    """(stepper, first input tokens, prompts for the penalties, max new tokens) for the model's family."""
    mcfg, B = model.config, inputs.shape[0]
    K = cfg.num_beams if not cfg.do_sample else 1
    if isinstance(model, EncoderDecoder):  # each source its own budget: a translation does not depend on its batch
        lengths = input_mask.sum(1).tolist() if input_mask is not None else [inputs.shape[1]] * B
        max_new = [translation_budget(model, int(n), cfg) for n in lengths]
        stepper = Seq2SeqStepper(model, inputs, input_mask, expand=K, capacity=max(max_new) + 1, compile=cfg.compile)
        return stepper, torch.full((B * K, 1), mcfg.bos_id, dtype=torch.long, device=inputs.device), None, max_new
    if isinstance(model, DecoderOnly):
        max_new = lm_budget(model, inputs.shape[1], cfg)
        stepper = DecoderOnlyStepper(model, inputs, input_mask, expand=K, capacity=inputs.shape[1] + max_new + 1,
                                     compile=cfg.compile)
        start = None if K == 1 else torch.zeros(B * K, 1, dtype=torch.long, device=inputs.device)
        mask = input_mask if input_mask is not None else torch.ones_like(inputs, dtype=torch.bool)
        return stepper, start, [row[m].tolist() for row, m in zip(inputs, mask.bool())], max_new
    raise TypeError(f"generation needs an EncoderDecoder or DecoderOnly model, got {type(model).__name__}")
