"""Generation: KV cache equals no cache, beam search properties, batching, sampling."""
import math
import shutil

import pytest
import torch

from attnlab import TransformerConfig, accel, build_model
from attnlab.generate import GenerationConfig, generate
from attnlab.generate.search import beam_search, length_penalty, log_softmax_, top_k_of_rows

POSITIONS = ["sinusoidal", "learned", "rope", "alibi", "none"]


def model_for(family, positions, **kw):
    cfg = dict(vocab_size=50, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64, dropout=0.0, positions=positions,
               max_len=64, norm_placement="pre", n_encoder_layers=2, n_decoder_layers=2)
    cfg.update(kw)
    torch.manual_seed(0)
    return build_model(TransformerConfig(family=family, **cfg)).eval()


@pytest.mark.parametrize("positions", POSITIONS)
def test_seq2seq_cache_matches_full_forward_with_padding(positions):
    model = model_for("encoder-decoder", positions)
    src = torch.randint(4, 50, (3, 7))
    src_mask = torch.arange(7)[None] < torch.tensor([7, 5, 3])[:, None]
    tgt = torch.randint(4, 50, (3, 9))
    with torch.no_grad():
        full = model(src, tgt, src_mask)
        memory = model.encode(src, src_mask)
        cache = model.new_cache()
        for t in range(9):
            step = model.decode(tgt[:, t: t + 1], memory, src_mask, cache=cache, last_only=True)
            assert (step - full[:, t]).abs().max() <= 1e-5, (positions, t)


@pytest.mark.parametrize("positions", POSITIONS)
def test_decoder_only_cache_matches_full_forward_with_left_padding(positions):
    model = model_for("decoder-only", positions)
    T = 10
    ids = torch.randint(4, 50, (3, T))
    mask = torch.ones(3, T, dtype=torch.bool)
    mask[1, :3] = False  # left padding
    mask[2, :6] = False
    with torch.no_grad():
        full = model(ids, mask)
        cache = model.new_cache()
        prefill = 4
        out = model(ids[:, :prefill], mask[:, :prefill], cache=cache)
        real = mask[:, :prefill]
        assert (out - full[:, :prefill])[real].abs().max() <= 1e-5
        for t in range(prefill, T):
            step = model(ids[:, t: t + 1], mask[:, : t + 1], cache=cache, last_only=True)
            assert (step - full[:, t]).abs().max() <= 1e-5, (positions, t)
        # A left-padded row equals its prompt alone.
        alone = model(ids[2:3, 6:])
        assert (alone[0] - full[2, 6:]).abs().max() <= 1e-5


@pytest.mark.parametrize("positions", POSITIONS)
def test_packed_forward_equals_separate_forwards(positions):
    """``forward_packed``: a cached one-token step of left-padded rows and a batch of new left-padded
    prompts in one pass give each group's last logits and caches as two separate forwards do."""
    model = model_for("decoder-only", positions)
    prompts = torch.randint(4, 50, (3, 6))
    pmask = torch.ones(3, 6, dtype=torch.bool)
    pmask[1, :2] = False
    new = torch.randint(4, 50, (2, 5))
    nmask = torch.ones(2, 5, dtype=torch.bool)
    nmask[0, :3] = False
    step = torch.randint(4, 50, (3, 1))
    smask = torch.cat([pmask, torch.ones(3, 1, dtype=torch.bool)], 1)
    with torch.no_grad():
        caches = {}
        for way in ("separate", "packed"):
            running, fresh = model.new_cache(), model.new_cache()
            model(prompts, pmask, cache=running)
            if way == "separate":
                got = [model(step, smask, cache=running, last_only=True), model(new, nmask, cache=fresh, last_only=True)]
            else:
                got = model.forward_packed([(step, smask, running), (new, nmask, fresh)])
            caches[way] = (got, running, fresh)
    (a, b), ra, fa = caches["separate"]
    (pa, pb), rb, fb = caches["packed"]
    assert pa.shape == (3, 50) and pb.shape == (2, 50)
    assert (pa - a).abs().max() <= 1e-5 and (pb - b).abs().max() <= 1e-5, positions
    for (x, _), (y, _) in zip(ra.layers + fa.layers, rb.layers + fb.layers):
        assert x.length == y.length and (x.k[:, :, :x.length] - y.k[:, :, :y.length]).abs().max() <= 1e-5


@pytest.mark.parametrize("positions", ["sinusoidal", "rope"])
def test_cache_follows_beam_reordering(positions):
    model = model_for("encoder-decoder", positions)
    src = torch.randint(4, 50, (2, 6)).repeat_interleave(2, 0)  # 2 sources × 2 beams
    tgt = torch.randint(4, 50, (4, 5))
    with torch.no_grad():
        memory = model.encode(src)
        cache = model.new_cache()
        for t in range(3):
            model.decode(tgt[:, t: t + 1], memory, cache=cache, last_only=True)
        perm = torch.tensor([1, 1, 3, 2])  # beams swap within each source's group
        cache.reorder(perm)
        tgt2 = tgt[perm]
        step = model.decode(tgt2[:, 3:4], memory, cache=cache, last_only=True)
        full = model(src, torch.cat([tgt2[:, :3], tgt2[:, 3:4]], 1))
        assert (step - full[:, 3]).abs().max() <= 1e-5


def test_kv_cache_reorders_into_its_spare_buffers():
    """KVCache.reorder writes the kept rows (and columns ``start:``) straight into the buffers of the
    reorder before: two buffers take turns, no new ones while the rows fit; contents equal index_select
    of what was there (the oracle), through appends, shrinking rows and a column cut."""
    from attnlab.model.attention import KVCache
    torch.manual_seed(0)
    c = KVCache(capacity=12)
    k, v = torch.randn(6, 2, 5, 4), torch.randn(6, 2, 5, 4)
    c.append(k, v)
    want_k, want_v = k, v
    ptrs = []
    for index, start in ((torch.tensor([5, 0, 0, 3, 2, 1]), 0), (torch.tensor([1, 1, 4, 0]), 0),
                         (torch.tensor([3, 2, 0]), 2), (torch.tensor([0, 2]), 0)):
        nk, nv = torch.randn(want_k.shape[0], 2, 1, 4), torch.randn(want_k.shape[0], 2, 1, 4)
        c.append(nk, nv)
        want_k, want_v = torch.cat([want_k, nk], 2), torch.cat([want_v, nv], 2)
        c.reorder(index, start=start)
        want_k, want_v = want_k[index][:, :, start:], want_v[index][:, :, start:]
        assert c.length == want_k.shape[2]
        assert torch.equal(c.k[:, :, :c.length], want_k) and torch.equal(c.v[:, :, :c.length], want_v)
        ptrs.append(c.k.data_ptr())
    assert len(set(ptrs[1:])) == 2 and ptrs[1] == ptrs[3]  # after the first, two buffers in turn


def test_beam_one_equals_greedy_and_nbest_is_sorted():
    model = model_for("encoder-decoder", "sinusoidal")
    src = torch.randint(4, 50, (4, 6))
    greedy = generate(model, src, max_new_tokens=12)
    beam1 = generate(model, src, max_new_tokens=12, num_beams=1)
    assert greedy.sequences == beam1.sequences
    beam = generate(model, src, max_new_tokens=12, num_beams=4, num_return_sequences=4)
    for hyps in beam.nbest:
        scores = [h.score for h in hyps]
        assert scores == sorted(scores, reverse=True) and len(hyps) == 4


class ToyStepper:
    """A crafted model over tokens {0: EOS, 1: a, 2: b}: greedy takes 'a' (p=0.6) and then faces a
    flat distribution; the best sequence is 'b EOS' (p=0.4)."""

    def __init__(self, rows):
        self.history = [[] for _ in range(rows)]
        self.started = False

    def step(self, tokens):
        if self.started:  # tokens are the ones just chosen for each row
            for h, t in zip(self.history, tokens.view(-1).tolist()):
                h.append(t)
        self.started = True
        table = []
        for h in self.history:
            p = [0.0, 0.6, 0.4] if not h else [1.0, 0.0, 0.0] if h[-1] == 2 else [0.34, 0.33, 0.33]
            table.append([math.log(x) if x > 0 else -1e9 for x in p])
        return torch.tensor(table)

    def select(self, rows, within_groups=False):
        self.history = [list(self.history[r]) for r in rows.tolist()]


def test_beam_search_finds_the_better_sequence_than_greedy():
    K = 2
    cfg = GenerationConfig(num_beams=K, length_penalty=0.0)
    hyps = beam_search(ToyStepper(K), 1, torch.zeros(K, 1, dtype=torch.long), cfg, eos_id=0, max_new_tokens=5)[0]
    assert hyps[0].tokens == [2]  # 'b' then EOS: p = 0.4
    assert math.isclose(hyps[0].score, math.log(0.4), rel_tol=1e-5)
    # greedy takes 'a' first (0.6) and ends with p <= 0.6 * 0.34 = 0.204
    greedy = ToyStepper(1)
    first = greedy.step(None).argmax(-1)
    assert first.item() == 1 and greedy.step(first[:, None]).exp().max() < 0.4 / 0.6


@pytest.mark.parametrize("family", ["encoder-decoder", "decoder-only"])
@pytest.mark.parametrize("beams", [1, 3])
def test_batch_equals_one_at_a_time(family, beams):
    model = model_for(family, "rope" if family == "decoder-only" else "sinusoidal")
    lengths = [6, 3, 5]
    seqs = [torch.randint(4, 50, (n,)) for n in lengths]
    T = max(lengths)
    batch = torch.zeros(3, T, dtype=torch.long)
    mask = torch.zeros(3, T, dtype=torch.bool)
    for i, s in enumerate(seqs):
        if family == "encoder-decoder":  # right padding for sources
            batch[i, : len(s)], mask[i, : len(s)] = s, True
        else:  # left padding for prompts
            batch[i, T - len(s):], mask[i, T - len(s):] = s, True
    cfg = GenerationConfig(max_new_tokens=8, num_beams=beams)
    together = generate(model, batch, mask, cfg).sequences
    alone = [generate(model, s[None], None, cfg).sequences[0] for s in seqs]
    assert together == alone


def test_sampling_is_reproducible_and_top_k_one_is_greedy():
    model = model_for("decoder-only", "rope")
    prompt = torch.randint(4, 50, (2, 4))
    a = generate(model, prompt, do_sample=True, seed=7, max_new_tokens=10, temperature=1.5).sequences
    b = generate(model, prompt, do_sample=True, seed=7, max_new_tokens=10, temperature=1.5).sequences
    c = generate(model, prompt, do_sample=True, seed=8, max_new_tokens=10, temperature=1.5).sequences
    assert a == b and a != c
    top1 = generate(model, prompt, do_sample=True, top_k=1, seed=3, max_new_tokens=10).sequences
    assert top1 == generate(model, prompt, max_new_tokens=10).sequences


def test_no_repeat_ngram_and_min_length():
    model = model_for("decoder-only", "rope")
    prompt = torch.randint(4, 50, (1, 3))
    out = generate(model, prompt, max_new_tokens=30, no_repeat_ngram_size=2).sequences[0]
    full = prompt[0].tolist() + out
    bigrams = list(zip(full, full[1:]))
    assert len(bigrams) == len(set(bigrams))
    model.config.eos_id = generate(model, prompt, max_new_tokens=1).sequences[0][0]  # the next token is EOS
    assert generate(model, prompt, max_new_tokens=5).sequences[0] == []
    assert len(generate(model, prompt, max_new_tokens=5, min_new_tokens=3).sequences[0]) >= 3


@pytest.mark.parametrize("V", [8000, 8003, 640, 100])  # whole chunks, a tail after them, few chunks (plain topk)
def test_top_k_of_rows_equals_topk(V):
    """The beam's top-2K by chunk maxima gives torch.topk's values and indices (the oracle), also with
    banned (-inf) tokens and a row whose best values all sit in one chunk."""
    torch.manual_seed(V)
    x = torch.randn(48, V).log_softmax(-1)
    x[1, :V // 2] = float("-inf")
    x[2, 5:13] = 10.0 + torch.arange(8.0)  # the 8 best in one chunk
    x[3, -3:] = 20.0                        # and in the tail (ties: compared as values only)
    for k in (1, 4, 8):
        want = x.topk(k, dim=-1)
        got = top_k_of_rows(x, k)
        assert torch.equal(got[0], want.values)
        assert torch.equal(x.gather(1, got[1]), want.values)  # the indices point at those values
        rows = [r for r in range(48) if r != 3]
        assert torch.equal(got[1][rows], want.indices[rows])


def test_log_softmax_in_place_equals_log_softmax():
    """The beam step's log-probabilities, written over its logits, equal ``log_softmax`` (the oracle):
    with banned (-inf) tokens, a huge logit, and a non-contiguous input (which gets a new tensor)."""
    torch.manual_seed(0)
    x = torch.randn(37, 1000) * 5
    x[0, :500] = float("-inf")
    x[1, 7] = 1e4
    want = x.log_softmax(-1)
    y = x.clone()
    got = log_softmax_(y)
    assert torch.equal(got, want) and got.data_ptr() == y.data_ptr()
    t = torch.empty(1000, 37).t().copy_(x)  # the same values, column-major
    got = log_softmax_(t)
    assert torch.equal(got, want) and got.data_ptr() != t.data_ptr() and torch.equal(t, x)


def test_length_penalty_is_gnmt():
    assert length_penalty(1, 0.6) == 1.0
    assert math.isclose(length_penalty(7, 0.6), 2.0 ** 0.6)
    assert length_penalty(10, 0.0) == 1.0


@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")), reason="torch.compile on CPU needs a C++ compiler")
def test_compiled_decode_step_matches_eager_in_bf16():
    """The compiled step (inductor, frozen weights) gives the eager step's logits in bf16."""
    from attnlab.generate.search import DecoderOnlyStepper
    torch.manual_seed(0)
    model = model_for("decoder-only", "rope", n_kv_heads=2).eval()
    model = model.to(torch.bfloat16)
    prompt = torch.randint(4, model.config.vocab_size, (2, 5))
    with torch.inference_mode():
        eager = DecoderOnlyStepper(model, prompt, None, capacity=16)
        compiled = DecoderOnlyStepper(model, prompt, None, capacity=16, compile=True)
        tok = None
        for _ in range(4):
            a, b = eager.step(tok), compiled.step(tok)
            torch.testing.assert_close(b, a, atol=3e-2, rtol=3e-2)
            tok = a.argmax(-1, keepdim=True)
    out = generate(model, prompt, max_new_tokens=6, min_new_tokens=6, compile=True)
    assert [len(s) for s in out.sequences] == [6, 6]


@pytest.mark.skipif(not accel.can_compile("cpu"), reason="no torch.compile here (no C++ compiler, or ATTNLAB_COMPILE=0)")
def test_compiled_fp32_step_streams_one_row_and_packs_many(monkeypatch):
    """fp32 on CPU compiles too: a step of one row multiplies as a streamed reduction
    (``accel.streamed_matvec``), a step of more rows calls oneDNN's kernel on the packs that
    ``PackedLinear.prepare_for_compile`` registered; both give the eager step's logits to float
    rounding. The packs are caches: not in the state dict, dropped by ``.to()``, never seen by a
    compile of the model outside the decoding step (a training step must not multiply by a frozen
    copy of weights it updates)."""
    from attnlab.generate.search import DecoderOnlyStepper
    traced_rows = []
    real = accel.streamed_matvec
    monkeypatch.setattr(accel, "streamed_matvec", lambda x, w, b=None: traced_rows.append(x.numel() // x.shape[-1]) or real(x, w, b))
    model = model_for("decoder-only", "rope", n_kv_heads=2, n_decoder_layers=1)
    keys = set(model.state_dict())
    for rows in (1, 3):
        traced_rows.clear()
        prompt = torch.randint(4, 50, (rows, 5))
        with torch.inference_mode():
            eager = DecoderOnlyStepper(model, prompt, None, capacity=16)
            compiled = DecoderOnlyStepper(model, prompt, None, capacity=16, compile=True)
            assert compiled.decode is not model
            tok = None
            for _ in range(3):
                a, b = eager.step(tok), compiled.step(tok)
                torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
                tok = a.argmax(-1, keepdim=True)
        assert bool(traced_rows) == (rows <= accel.STREAMED_MAX_ROWS), (rows, traced_rows)
    packs = [m for m in model.modules() if isinstance(m, accel.PackedLinear) and "packed_weight" in m._buffers]
    assert packs or not accel.packed_linear_ok(torch.float32)
    assert set(model.state_dict()) == keys
    # a compile of the same model for training: gradients of its own weights, not of the frozen packs
    model.train()
    x = torch.randint(4, 50, (2, 6))
    want = torch.autograd.grad(model(x).square().mean(), model.decoder.layers[0].feed_forward.w_in.weight)[0]
    got = torch.autograd.grad(torch.compile(model)(x).square().mean(), model.decoder.layers[0].feed_forward.w_in.weight)[0]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    model.to(torch.float64)  # the opaque packs cannot be cast: they are dropped
    assert not any("packed_weight" in m._buffers for m in model.modules())
