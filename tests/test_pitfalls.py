"""One test for each classic implementation pitfall (shared/CONCEPTS.md) and the paper's sizes."""
import math

import pytest
import torch
import torch.nn.functional as F

from attnlab import TransformerConfig, build_model, get_preset
from attnlab.model import (LearnedPositionalEmbedding, MultiHeadAttention, SinusoidalPositionalEncoding,
                           TokenEmbedding, causal_mask, combine_masks, scaled_dot_product_attention,
                           sinusoidal_table)


def tiny_mt(**kw):
    base = dict(vocab_size=60, d_model=32, n_heads=4, n_encoder_layers=2, n_decoder_layers=2, d_ff=64,
                dropout=0.0)
    return build_model(TransformerConfig(**{**base, **kw})).eval()


def test_causal_mask_is_the_lower_triangle():
    m = causal_mask(4)[0, 0]
    assert torch.equal(m, torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool))
    # With a KV cache: the last query row sees all keys.
    assert causal_mask(1, 5)[0, 0].all()
    # And the model really uses it: decoder self-attention weights above the diagonal are zero.
    model = tiny_mt()
    attn = model.decoder.layers[0].self_attn
    attn.record_weights = True
    model(torch.randint(4, 60, (1, 5)), torch.randint(4, 60, (1, 6)))
    w = attn.last_weights[0]
    lower = torch.ones_like(w, dtype=torch.bool).tril()
    assert (w[~lower] == 0).all() and (w[lower] > 0).all()


def test_heads_are_split_and_merged_correctly():
    """Against a per-head loop (the slow, obviously-correct form). A `view` after `transpose`
    without `contiguous()` fails or scrambles heads; this catches both."""
    torch.manual_seed(0)
    d, h = 24, 3
    attn = MultiHeadAttention(d, h).eval()
    x = torch.randn(2, 5, d)
    Wq, Wk, Wv = attn.qkv_proj.weight.split(d)
    bq, bk, bv = attn.qkv_proj.bias.split(d)
    heads = []
    for i in range(h):
        s = slice(i * d // h, (i + 1) * d // h)
        q, k, v = x @ Wq[s].T + bq[s], x @ Wk[s].T + bk[s], x @ Wv[s].T + bv[s]
        heads.append(torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d // h), -1) @ v)
    expected = attn.out_proj(torch.cat(heads, -1))
    assert torch.allclose(attn(x), expected, atol=1e-6)


def test_padding_does_not_leak_into_attention():
    model = tiny_mt()
    src = torch.randint(4, 60, (1, 5))
    tgt = torch.randint(4, 60, (1, 4))
    alone = model(src, tgt)
    for filler in (0, 17):  # whatever the padding contains, real positions are unchanged
        padded = torch.cat([src, torch.full((1, 3), filler)], 1)
        mask = torch.tensor([[1, 1, 1, 1, 1, 0, 0, 0]], dtype=torch.bool)
        assert torch.allclose(model(padded, tgt, mask), alone, atol=1e-5)


def test_cross_attention_takes_keys_and_values_from_the_encoder():
    model = tiny_mt()
    src, tgt = torch.randint(4, 60, (2, 6)), torch.randint(4, 60, (2, 5))
    seen = []
    model.decoder.layers[1].cross_attn.kv_proj.register_forward_hook(lambda m, a, o: seen.append(a[0]))
    model(src, tgt)
    assert torch.equal(seen[0], model.encode(src))
    # and the queries come from the decoder: changing the source changes the output
    assert not torch.allclose(model(src, tgt), model(torch.randint(4, 60, (2, 6)), tgt))


def test_embedding_is_scaled_by_sqrt_d_model():
    emb = TokenEmbedding(10, 64)
    ids = torch.tensor([[1, 2, 3]])
    assert torch.allclose(emb(ids), F.embedding(ids, emb.weight) * 8.0)
    plain = TokenEmbedding(10, 64, scale=False)
    assert torch.allclose(plain(ids), F.embedding(ids, plain.weight))


@pytest.mark.parametrize("d", [8, 512])
def test_sinusoidal_formula(d):
    T = 600  # past the cached table: any length works
    pe = SinusoidalPositionalEncoding(d)(torch.arange(T))
    for pos in (0, 1, 7, 599):
        for i in range(0, d // 2, max(1, d // 16)):
            assert math.isclose(pe[pos, 2 * i].item(), math.sin(pos / 10000 ** (2 * i / d)), abs_tol=2e-5)
            assert math.isclose(pe[pos, 2 * i + 1].item(), math.cos(pos / 10000 ** (2 * i / d)), abs_tol=2e-5)
    # The "split" layout (fairseq/Marian) is the same features, sines first.
    split = sinusoidal_table(torch.arange(T), d, "split")
    assert torch.allclose(split[:, : d // 2], pe[:, 0::2]) and torch.allclose(split[:, d // 2:], pe[:, 1::2])
    # PE(pos + k) is a linear function (a rotation per frequency) of PE(pos).
    k = 5
    w = torch.exp(torch.arange(0, d, 2) * (-math.log(10000.0) / d))
    s, c = pe[:, 0::2], pe[:, 1::2]
    assert torch.allclose(s[k:], s[:-k] * torch.cos(k * w) + c[:-k] * torch.sin(k * w), atol=1e-4)


def test_learned_positions_have_a_clear_limit():
    table = LearnedPositionalEmbedding(8, 4)
    table(torch.arange(8))
    with pytest.raises(ValueError, match="position 8 is past the learned position table"):
        table(torch.arange(9))


def test_paper_base_parameter_count():
    d, ff, V, N = 512, 2048, 37000, 6
    attention = 4 * (d * d + d)  # W_Q, W_K, W_V, W_O with biases
    ffn = d * ff + ff + ff * d + d
    norm = 2 * d
    encoder_layer = attention + ffn + 2 * norm
    decoder_layer = 2 * attention + ffn + 3 * norm
    embedding = V * d  # one matrix: source, target and pre-softmax (joint vocabulary, tied)
    expected = N * encoder_layer + N * decoder_layer + embedding
    assert expected == 63_082_496
    assert build_model(get_preset("paper-base")).num_parameters() == expected


def test_tying_shares_one_parameter():
    model = build_model(get_preset("mt-tiny"))
    assert model.lm_head.weight is model.src_embed.token.weight is model.tgt_embed.token.weight
    untied = build_model(get_preset("mt-tiny", tie_output=False, share_embeddings=False, tgt_vocab_size=500))
    assert untied.lm_head.weight is not untied.tgt_embed.token.weight
    assert untied.lm_head.weight.shape == (500, 64)


def _attention_oracle(q, k, v, mask=None, bias=None, scale=None):
    """float64 softmax(QKᵀ·scale + bias + mask)·V (scale 1/√d unless given) with K/V repeated per query
    head (GQA), rows without keys zeroed."""
    q, k, v = q.double(), k.double(), v.double()
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    scores = (q @ k.transpose(-1, -2)) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if bias is not None:
        scores = scores + bias.double()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = scores.softmax(-1).nan_to_num(0.0)
    return weights @ v


def _graph(t) -> list:
    """The autograd nodes behind t."""
    seen, todo = {}, [t.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is not None and id(fn) not in seen:
            seen[id(fn)] = fn
            todo += [f for f, _ in fn.next_functions]
    return list(seen.values())


def _graph_nodes(t) -> set[str]:
    """The names of the autograd nodes behind t."""
    return {type(fn).__name__ for fn in _graph(t)}


def _attention_path(monkeypatch, path):
    """``kernel``: ShortAttention's fp32 inputs take attnlab's kernel (skipped where it cannot build); ``torch``:
    its torch path (the kernel's cached answer switched off; the other kernels stay as they are)."""
    from attnlab.model import attention
    if path == "torch":
        monkeypatch.setattr(attention, "_SHORT", {"ok": False})
    else:
        _dropout_path(monkeypatch, "kernel")
        assert attention.fused_short_attention()  # (where the tools are, a failed build or check fails here)


def _short_attention_nodes(out) -> list:
    """The ShortAttention nodes of out's graph."""
    return [fn for fn in _graph(out) if type(fn).__name__ == "ShortAttentionBackward"]


def _assert_same_training(kernel: tuple, torch_path: tuple) -> None:
    """(loss, gradients) of a model on attnlab's kernel and on the torch path: equal to fp32 rounding."""
    assert torch.allclose(kernel[0], torch_path[0], rtol=1e-5)
    assert len(kernel[1]) == len(torch_path[1]) > 10
    for a, b in zip(kernel[1], torch_path[1]):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6), (a - b).abs().max()


def _short_attention_kernel_used(out, each: bool = False):
    """{whether each ShortAttention in out's graph ran on attnlab's kernel} (``each``: a list, one per attention)."""
    used = [fn.kernel for fn in _short_attention_nodes(out)]
    return used if each else set(used)


def _packed_attention_nodes(out) -> list:
    """The attnlab::packed_self_attention nodes of out's graph (a C++ autograd function: ShortAttention's kernel)."""
    return [fn for fn in _graph(out) if fn.name().endswith("::PackedSelfAttention>")]


@pytest.mark.parametrize("path", ["kernel", "torch"])
@pytest.mark.parametrize("case", ["causal", "padding", "gqa_causal_padding", "shifted_causal", "empty_rows"])
def test_short_key_training_attention_equals_the_oracle(monkeypatch, case, path):
    """Training on CPU with ≤ SHORT_KEYS keys takes ShortAttention (attnlab's kernel for fp32, or two batched matmuls
    and a softmax, hand-written backward): its output and the gradients of q, k, v equal a float64 oracle's, for
    every mask kind, on both paths (the kernel's causal skipping among them: shifted, and with padding)."""
    from attnlab.model.attention import SHORT_KEYS, padding_mask
    _attention_path(monkeypatch, path)
    torch.manual_seed(0)
    B, h, kv, Tq, Tk = 3, 4, 4, 12, 12
    is_causal, mask = False, None
    if case == "causal":
        is_causal = True
    elif case == "padding":
        tok = torch.ones(B, Tk, dtype=torch.bool)
        tok[0, -5:] = False
        mask = padding_mask(tok)
    elif case == "gqa_causal_padding":
        kv, is_causal = 2, True
        tok = torch.ones(B, Tk, dtype=torch.bool)
        tok[1, -3:] = False
        mask = padding_mask(tok)
    elif case == "shifted_causal":  # queries are the last Tq of Tk positions
        Tq, is_causal = 5, True
    elif case == "empty_rows":  # left padding under the causal mask: the first query rows see no key
        is_causal = True
        tok = torch.ones(B, Tk, dtype=torch.bool)
        tok[2, :4] = False
        mask = padding_mask(tok)
    assert Tk <= SHORT_KEYS
    q, k, v = torch.randn(B, h, Tq, 8), torch.randn(B, kv, Tk, 8), torch.randn(B, kv, Tk, 8)
    grad = torch.randn(B, h, Tq, 8)
    full = combine_masks(mask, causal_mask(Tq, Tk) if is_causal else None)
    ref_in = [t.double().requires_grad_() for t in (q, k, v)]
    ref = _attention_oracle(*ref_in, full)
    ref.backward(grad.double())
    ins = [t.clone().requires_grad_() for t in (q, k, v)]
    out, _ = scaled_dot_product_attention(*ins, mask=mask, is_causal=is_causal)
    assert _short_attention_kernel_used(out) == {path == "kernel"}
    assert out.transpose(1, 2).is_contiguous()  # in the (B, T, h, hd) memory the heads are merged from: no copy there
    out.backward(grad)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    for got, want in zip(ins, ref_in):
        torch.testing.assert_close(got.grad.double(), want.grad, atol=1e-5, rtol=1e-5)
    if case == "empty_rows":
        assert torch.equal(out[2, :, :4], torch.zeros_like(out[2, :, :4]))
    # a gradient that is a broadcast view (out.sum()'s: every stride 0)
    summed = [t.clone().requires_grad_() for t in (q, k, v)]
    scaled_dot_product_attention(*summed, mask=mask, is_causal=is_causal)[0].sum().backward()
    summed_ref = [t.double().requires_grad_() for t in (q, k, v)]
    _attention_oracle(*summed_ref, full).sum().backward()
    for got, want in zip(summed, summed_ref):
        torch.testing.assert_close(got.grad.double(), want.grad, atol=1e-5, rtol=1e-5)
    if Tq != Tk:
        return
    # the gradients of q, k, v split from one projection, as the model does: each comes back in the (B, T, h, hd)
    # memory the split's view and transpose came from (so their backward copies nothing), with the oracle's values
    qkv = torch.cat([t.transpose(1, 2).reshape(B, -1, t.shape[1] * 8) for t in (q, k, v)], -1).requires_grad_()
    views = [t.view(B, t.shape[1], -1, 8).transpose(1, 2) for t in qkv.split([h * 8, kv * 8, kv * 8], -1)]
    out2, _ = scaled_dot_product_attention(*views, mask=mask, is_causal=is_causal)
    grads = torch.autograd.grad(out2, views, grad)
    for got, want in zip(grads, ref_in):
        assert got.transpose(1, 2).is_contiguous()
        torch.testing.assert_close(got.double(), want.grad, atol=1e-5, rtol=1e-5)
    half = qkv.detach().bfloat16().requires_grad_()  # in bf16 the same layout, cast in the same copy
    views = [t.view(B, t.shape[1], -1, 8).transpose(1, 2) for t in half.split([h * 8, kv * 8, kv * 8], -1)]
    out3, _ = scaled_dot_product_attention(*views, mask=mask, is_causal=is_causal)
    assert _short_attention_kernel_used(out3) == {False}  # (the kernel is fp32 only)
    for got in torch.autograd.grad(out3, views, grad.bfloat16()):
        assert got.dtype == torch.bfloat16 and got.transpose(1, 2).is_contiguous()


@pytest.mark.parametrize("isa", ["native", "avx2", "baseline"])
def test_attention_kernel_rows_of_every_length(monkeypatch, isa):
    """The kernel's operators against float64 where its vector loops have tails: rows of 1-64 keys (one lane
    to four whole vectors, the softmax's masked lanes among them) and of 100 and 112 (more vectors of causal
    scores than one block of columns), causal or not, more keys than queries, more
    queries than keys (rows that see no key: zeros), a broadcast bias with -inf entries (with a causal mask too),
    head sizes that are and are not a multiple of the vector; the probabilities it hands the backward are the
    softmax's, zero past each row's last key, and a backward given them in another layout (contiguous) gives the
    same gradients. ``avx2``: the same in a child process capped at AVX2 (8 lanes; accel.AVX2_ENVIRONMENT), on
    CPUs with AVX-512; ``baseline``: at PyTorch's default capability (4 lanes, the build of CPUs without AVX2)."""
    import os
    import subprocess
    import sys
    from attnlab import accel
    if isa != "native":
        if os.environ.get("ATEN_CPU_CAPABILITY"):
            pytest.skip("capped already")
        if not ({"avx512f", "avx2"} if isa == "avx2" else {"avx2"}) <= accel.cpu_flags():
            pytest.skip(f"the {isa} build is the native one on this CPU")
        _own_kernels_on(monkeypatch)
        env = accel.AVX2_ENVIRONMENT if isa == "avx2" else {"ATEN_CPU_CAPABILITY": "default"}
        res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                              f"{__file__}::test_attention_kernel_rows_of_every_length[native]"],
                             env={**os.environ, **env}, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0 and "1 passed" in res.stdout, res.stdout[-3000:] + res.stderr[-2000:]
        return
    from attnlab.model import attention
    _own_kernels_on(monkeypatch)
    assert attention.fused_short_attention()  # (where the tools are, a failed build or check fails here)
    torch.manual_seed(0)
    ops = torch.ops.attnlab
    for n, Tk in enumerate((1, 7, 8, 9, 15, 16, 17, 24, 31, 33, 50, 64, 100, 112)):
        for causal, Tq, with_bias in ((False, Tk, True), (True, Tk, False), (True, max(1, Tk // 2), True),
                                      (True, Tk + 3, False)):
            B, h, kv, hd = 2, 4, 2, (12, 16)[n % 2]
            x = torch.randn(B, max(Tq, Tk), 3, h, hd)  # (q, k, v from one projection's memory, as the model has them)
            q, k, v = x[:, :Tq, 0].transpose(1, 2), x[:, :Tk, 1, :kv].transpose(1, 2), x[:, :Tk, 2, :kv].transpose(1, 2)
            bias = None
            if with_bias:
                bias = torch.randn(B, 1, 1, Tk).masked_fill(torch.rand(B, 1, 1, Tk) < 0.2, float("-inf"))
                bias[..., 0] = 0.0  # (every row that sees a key sees one with a finite score)
            out, probs = ops.short_attention(q, k, v, bias, 0.3, causal)
            q64, k64, v64 = (t.double() for t in (q, k, v))
            k64, v64 = k64.repeat_interleave(h // kv, 1), v64.repeat_interleave(h // kv, 1)
            s = q64 @ k64.transpose(-1, -2) * 0.3 + (0 if bias is None else bias.double())
            if causal:
                s = s.masked_fill(~causal_mask(Tq, Tk, "cpu"), float("-inf"))
            p = s.softmax(-1).nan_to_num(0.0)  # (a row that sees no key: zeros)
            torch.testing.assert_close(probs.double(), p, atol=1e-6, rtol=1e-5)
            assert bool((probs[p == 0] == 0).all())
            torch.testing.assert_close(out.double(), p @ v64, atol=1e-5, rtol=1e-5)
            g = torch.randn(B, h, Tq, hd)
            dp = g.double() @ v64.transpose(-1, -2)
            ds = p * (dp - (dp * p).sum(-1, keepdim=True)) * 0.3
            want = (ds @ k64, (ds.transpose(-1, -2) @ q64).unflatten(1, (kv, h // kv)).sum(2),
                    (p.transpose(-1, -2) @ g.double()).unflatten(1, (kv, h // kv)).sum(2))
            got = ops.short_attention_backward(g, q, k, v, probs, 0.3, causal)
            for a, w in zip(got, want):
                torch.testing.assert_close(a.double(), w, atol=1e-5, rtol=1e-5)
            again = ops.short_attention_backward(g, q, k, v, probs.contiguous(), 0.3, causal)
            assert all(torch.equal(a, b) for a, b in zip(got, again))


@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_short_key_training_attention_edge_cases(monkeypatch, path):
    """ShortAttention beside the oracle where the model's callers differ from the plain case: a float bias
    and scale=1 (ALiBi), a learned bias and its gradient (T5), a per-query (B, 1, Tq, Tk) mask, non-contiguous views,
    gradients for q only, fewer queries than keys under is_causal (aligned as causal_mask, in training
    and inference alike), bf16 inputs with GQA and a learned bias (fp32 inside, bf16 out and back), fp16 inputs
    (computed in fp32: finite where fp16 scores would overflow), and a second derivative, which it refuses
    rather than gets wrong. On both paths: a learned bias and half precision keep the torch path."""
    _attention_path(monkeypatch, path)
    torch.manual_seed(0)
    B, h, T, hd = 2, 4, 10, 8
    qkv = torch.randn(B, T, 3 * h * hd)
    q, k, v = (t.view(B, T, h, hd).transpose(1, 2) for t in qkv.split(h * hd, dim=-1))  # non-contiguous views
    bias = torch.randn(1, h, T, T)
    mask = torch.rand(B, 1, T, T) > 0.3
    mask[..., 0] = True
    for kw in ({"bias": bias, "scale": 1.0}, {"mask": mask}):
        for grads in ((True, True, True), (True, False, False)):
            ins = [t.clone().requires_grad_(g) for t, g in zip((q, k, v), grads)]
            out, _ = scaled_dot_product_attention(*ins, **kw)
            assert _short_attention_kernel_used(out) == {path == "kernel"}
            ref_in = [t.double().requires_grad_(g) for t, g in zip((q, k, v), grads)]
            ref = _attention_oracle(*ref_in, **kw)
            torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
            grad = torch.randn_like(out)
            out.backward(grad)
            ref.backward(grad.double())
            for got, want in zip(ins, ref_in):
                assert (got.grad is None) == (want.grad is None)
                if want.grad is not None:
                    torch.testing.assert_close(got.grad.double(), want.grad, atol=1e-5, rtol=1e-5)
    # a learned bias (T5's relative positions), under a padding mask: its gradient too
    tok = torch.ones(B, T, dtype=torch.bool)
    tok[1, -3:] = False
    learned, ref_bias = bias.clone().requires_grad_(), bias.double().requires_grad_()
    ins = [t.clone().requires_grad_() for t in (q, k, v)]
    out, _ = scaled_dot_product_attention(*ins, mask=tok[:, None, None, :], bias=learned, scale=1.0)
    assert _short_attention_kernel_used(out) == {False}  # (a bias with a gradient: the torch path)
    ref_in = [t.double().requires_grad_() for t in (q, k, v)]
    ref = _attention_oracle(*ref_in, tok[:, None, None, :], bias=ref_bias, scale=1.0)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad.double())
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    for got, want in zip([*ins, learned], [*ref_in, ref_bias]):
        torch.testing.assert_close(got.grad.double(), want.grad, atol=1e-5, rtol=1e-5)
    # bf16 inputs (autocast's projections) with GQA and a bf16 learned bias under padding: computed in fp32,
    # returned and differentiated in bf16
    half = [t.bfloat16().requires_grad_() for t in (q, k[:, :2], v[:, :2])]
    learned = bias.bfloat16().requires_grad_()
    out, _ = scaled_dot_product_attention(*half, mask=tok[:, None, None, :], bias=learned, scale=1.0)
    assert _short_attention_kernel_used(out) == {False} and out.dtype == torch.bfloat16
    ref_in = [t.detach().double().requires_grad_() for t in half]
    ref_bias = learned.detach().double().requires_grad_()
    ref = _attention_oracle(*ref_in, tok[:, None, None, :], bias=ref_bias, scale=1.0)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad.double())
    torch.testing.assert_close(out.double(), ref, atol=1e-2, rtol=1e-2)  # bf16 rounding of the result
    for got, want in zip([*half, learned], [*ref_in, ref_bias]):
        assert got.grad.dtype == torch.bfloat16
        torch.testing.assert_close(got.grad.double(), want.grad, atol=2e-2 * want.grad.abs().max().item(), rtol=2e-2)
    q5 = q[:, :, -4:].clone().requires_grad_()
    trained, _ = scaled_dot_product_attention(q5, k, v, is_causal=True)
    with torch.no_grad():
        inferred, _ = scaled_dot_product_attention(q5, k, v, is_causal=True)
    expected = _attention_oracle(q5.detach(), k, v, causal_mask(4, T))
    torch.testing.assert_close(trained.double(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(inferred.double(), expected, atol=1e-5, rtol=1e-5)
    # more queries than keys under is_causal: the first rows see no key (output 0, gradients finite and the oracle's)
    for dtype in (torch.float32, torch.bfloat16):
        few = [t.to(dtype, copy=True).requires_grad_() for t in (q, k[:, :, :3], v[:, :, :3])]
        out, _ = scaled_dot_product_attention(*few, is_causal=True)
        assert _short_attention_kernel_used(out) == {path == "kernel" and dtype == torch.float32}
        grad = torch.randn_like(out)
        out.backward(grad)
        ref_in = [t.detach().double().requires_grad_() for t in few]
        ref = _attention_oracle(*ref_in, causal_mask(T, 3))
        ref.backward(grad.double())
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        assert torch.equal(out[:, :, :T - 3].float(), torch.zeros_like(out[:, :, :T - 3].float()))
        torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
        for got, want in zip(few, ref_in):
            assert torch.isfinite(got.grad).all()
            torch.testing.assert_close(got.grad.double(), want.grad, atol=tol * 3, rtol=tol * 3)
    # a NaN key makes the output NaN, as in torch's softmax (a loss check must see it)
    bad_k = k.clone()
    bad_k[0, 0, 5, 0] = float("nan")
    out, _ = scaled_dot_product_attention(q.requires_grad_(), bad_k, v)
    assert out[0, 0].isnan().all() and not out[1].isnan().any()
    q.requires_grad_(False)
    big = [(t * 40).half().requires_grad_() for t in (q, k, v)]  # fp16 q·k reaches ~1e5: past fp16's 65504
    out, _ = scaled_dot_product_attention(*big, is_causal=True)
    out.float().sum().backward()
    assert out.dtype == torch.float16 and torch.isfinite(out).all() and all(torch.isfinite(t.grad).all() for t in big)
    ins = [t.clone().requires_grad_() for t in (q, k, v)]
    out, _ = scaled_dot_product_attention(*ins, is_causal=True)
    (gq,) = torch.autograd.grad(out.square().sum(), ins[0], create_graph=True)
    with pytest.raises(RuntimeError):
        gq.sum().backward()


@pytest.mark.parametrize("preset", ["mt-tiny", "llama-mini", "vit-mnist"])
def test_attention_kernel_trains_the_model_as_the_torch_path_does(monkeypatch, preset):
    """Whole models in training: the loss and every gradient with attnlab's attention kernel equal those of
    ShortAttention's torch path to fp32 rounding, and every attention of the model ran on the kernel. An
    encoder-decoder over padded sources and targets (padding, causal skipping with padding, cross-attention with
    fewer keys than queries), a Llama (GQA, RoPE, a padded batch) and a ViT (50 tokens, heads of 16)."""
    torch.manual_seed(0)
    cfg = get_preset(preset, dropout=0.0, **({"vocab_size": 50} if preset != "vit-mnist" else {}))
    model = build_model(cfg).train()
    if preset == "mt-tiny":
        src, tgt = torch.randint(4, 50, (3, 9)), torch.randint(4, 50, (3, 13))
        src_ok, tgt_ok = torch.ones(3, 9, dtype=torch.bool), torch.ones(3, 13, dtype=torch.bool)
        src_ok[1, -4:], tgt_ok[2, -5:] = False, False
        attentions = cfg.n_encoder_layers + 2 * cfg.n_decoder_layers  # (self- and cross-attention)

        def run():
            return model(src, tgt, src_ok, tgt_ok).logsumexp(-1)[tgt_ok].mean()
    elif preset == "llama-mini":
        ids, ok = torch.randint(4, 50, (3, 17)), torch.ones(3, 17, dtype=torch.bool)
        ok[0, :6] = False  # left padding
        attentions = cfg.n_decoder_layers

        def run():
            return F.cross_entropy(model(ids, ok)[ok], ids[ok])
    else:
        images, attentions = torch.randn(3, 1, 28, 28), cfg.n_encoder_layers

        def run():
            return model(images).logsumexp(-1).mean()
    results = {}
    for path in ("kernel", "torch"):
        _attention_path(monkeypatch, path)
        model.zero_grad(set_to_none=True)
        loss = run()
        # the ViT's unmasked self-attention takes the packed operator (the kernel behind a C++ autograd function)
        packed = len(_packed_attention_nodes(loss))
        assert packed == (attentions if preset == "vit-mnist" and path == "kernel" else 0)
        used = _short_attention_kernel_used(loss, each=True) + [True] * packed
        if path == "kernel":  # what the kernel's backward keeps: q, k, v as they are where together they cover
            views = 0         # their memory (a fused projection's split), else a compact copy (v beside RoPE's q, k)
            for fn in _short_attention_nodes(loss):
                kept: dict = {}
                for t in {id(t): t for t in fn.saved_tensors[:3]}.values():
                    nbytes, used_bytes = kept.get(t.untyped_storage().data_ptr(), (t.untyped_storage().nbytes(), 0))
                    kept[t.untyped_storage().data_ptr()] = (nbytes, used_bytes + t.numel() * t.element_size())
                assert all(nbytes == used_bytes for nbytes, used_bytes in kept.values())  # nothing more kept alive
                views += any(t.untyped_storage().nbytes() > t.numel() * t.element_size() for t in fn.saved_tensors[:3])
            # (RoPE: q, k new tensors, v a compact copy; the ViT's attentions are all packed)
            assert views == (0 if preset in ("llama-mini", "vit-mnist") else attentions)
        loss.backward()
        results[path] = (loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None], used)
    assert results["kernel"][2] == [True] * attentions and results["torch"][2] == [False] * attentions
    _assert_same_training(results["kernel"][:2], results["torch"][:2])


@pytest.mark.parametrize("case", ["causal", "full", "gqa", "gqa_unaligned_head", "strided_input", "transposed_input"])
def test_packed_self_attention_equals_the_oracle(monkeypatch, case):
    """attnlab::packed_self_attention (self-attention over the fused projection, its gradient written into one
    tensor by its C++ autograd function) against a float64 oracle: the output and qkv's gradient, causal or not,
    GQA with a head size the vectors do not divide, a projection that is a strided view; a broadcast gradient
    (out.sum()'s); and a second derivative (create_graph takes differentiable ops, a hook on the input runs once)."""
    _own_kernels_on(monkeypatch)
    _attention_path(monkeypatch, "kernel")
    torch.manual_seed(0)
    B, T, h, kv, hd, causal = 3, 11, 4, 4, 16, case != "full"
    if case == "gqa":
        T, kv = 37, 2
    if case == "gqa_unaligned_head":
        kv, hd = 2, 20
    width = (h + 2 * kv) * hd
    if case == "transposed_input":  # (features not contiguous: the operator takes a contiguous copy)
        qkv = torch.randn(B, width, T).requires_grad_()
        x = qkv.transpose(1, 2)
    else:
        base = torch.randn(B, T, width + (5 if case == "strided_input" else 0))
        qkv = base[..., :width].requires_grad_() if case != "strided_input" else base.requires_grad_()
        x = qkv[..., :width] if case == "strided_input" else qkv
    assert x.is_contiguous() == (case not in ("strided_input", "transposed_input"))
    out = torch.ops.attnlab.packed_self_attention(x, h, kv, 0.25, causal)
    g = torch.randn(B, T, h * hd)
    (got,) = torch.autograd.grad(out, qkv, g)
    ref_in = x.detach().double().requires_grad_()
    q, k, v = ref_in.split([h * hd, kv * hd, kv * hd], -1)
    want = _attention_oracle(q.view(B, T, h, hd).transpose(1, 2), k.view(B, T, kv, hd).transpose(1, 2),
                             v.view(B, T, kv, hd).transpose(1, 2), causal_mask(T, T) if causal else None, scale=0.25)
    want = want.transpose(1, 2).reshape(B, T, h * hd)
    (want_grad,) = torch.autograd.grad(want, ref_in, g.double(), retain_graph=True)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    if case == "transposed_input":
        got = got.transpose(1, 2)
    torch.testing.assert_close(got[..., :width].double(), want_grad, atol=1e-5, rtol=1e-5)
    if case == "strided_input":
        assert torch.equal(got[..., width:], torch.zeros_like(got[..., width:]))
    summed = torch.autograd.grad(torch.ops.attnlab.packed_self_attention(x, h, kv, 0.25, causal).sum(), x)[0]
    (summed_want,) = torch.autograd.grad(want.sum(), ref_in, retain_graph=True)
    torch.testing.assert_close(summed.double(), summed_want, atol=1e-5, rtol=1e-5)
    # a second derivative (create_graph: the backward in differentiable ops), against the oracle's
    hooked = x * 1  # (a hook on the operator's input runs once under create_graph too)
    calls = []
    hooked.register_hook(lambda g: calls.append(1))
    again = torch.ops.attnlab.packed_self_attention(hooked, h, kv, 0.25, causal)
    (first,) = torch.autograd.grad(again.pow(2).sum(), x, create_graph=True)
    assert len(calls) == 1
    (second,) = torch.autograd.grad(first.pow(2).sum(), x)
    (first_want,) = torch.autograd.grad(want.pow(2).sum(), ref_in, create_graph=True)
    (second_want,) = torch.autograd.grad(first_want.pow(2).sum(), ref_in)
    torch.testing.assert_close(first.double(), first_want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(second.double(), second_want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_gradients_through_a_kv_cache(monkeypatch, path):
    """Gradients through cached decoding, whose next step writes the cache's buffer in place: the backward runs
    (the kernel keeps compact copies of the cache's views, not the views) and equals the uncached forward's."""
    _attention_path(monkeypatch, path)
    torch.manual_seed(0)
    model = build_model(get_preset("shakespeare-char", vocab_size=40, dropout=0.0)).train()
    ids = torch.randint(1, 40, (2, 6))
    cache = model.new_cache(capacity=16)
    (model(ids[:, :4], cache=cache).sum() + model(ids[:, 4:], cache=cache).sum()).backward()
    cached = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    model(ids).sum().backward()
    for a, b in zip(cached, (p.grad for p in model.parameters())):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_attention_keeps_the_fused_kernel_outside_short_key_training():
    """Longer keys, attention dropout, inference and requested weights keep the other paths."""
    from attnlab.model.attention import SHORT_KEYS_KERNEL
    q, k, v = (torch.randn(1, 2, 4, 8, requires_grad=True) for _ in range(3))
    long_k = torch.randn(1, 2, SHORT_KEYS_KERNEL + 1, 8, requires_grad=True)
    for out in (scaled_dot_product_attention(q, long_k, long_k)[0],
                scaled_dot_product_attention(q, k, v, dropout_p=0.1)[0],
                scaled_dot_product_attention(q, k, v, need_weights=True)[0]):
        assert "ShortAttentionBackward" not in _graph_nodes(out)
    with torch.no_grad():
        assert scaled_dot_product_attention(q, k, v)[0].grad_fn is None


def test_attention_kernel_takes_longer_keys_where_it_serves(monkeypatch):
    """Between SHORT_KEYS and SHORT_KEYS_KERNEL keys, training attention in fp32 runs on attnlab's kernel (which
    beat PyTorch's fused kernel there, in whole updates) and equals a float64 oracle, causal and with padding; the
    torch path of ShortAttention does not (bf16 inputs, a bias that needs a gradient, the kernel switched off) and
    the fused kernel serves those, as past SHORT_KEYS_KERNEL."""
    from attnlab.model import attention
    from attnlab.model.attention import SHORT_KEYS, SHORT_KEYS_KERNEL, padding_mask
    _own_kernels_on(monkeypatch)
    _attention_path(monkeypatch, "kernel")
    assert SHORT_KEYS < 100 <= SHORT_KEYS_KERNEL
    torch.manual_seed(0)
    B, h, T, hd = 2, 4, 100, 16
    x = torch.randn(B, T, 3, h, hd)
    keep = torch.ones(B, T, dtype=torch.bool)
    keep[1, 90:] = False
    for is_causal, mask in ((True, None), (False, padding_mask(keep))):
        q, k, v = (x[:, :, i].transpose(1, 2).requires_grad_() for i in range(3))
        out, _ = scaled_dot_product_attention(q, k, v, mask, is_causal=is_causal)
        assert _short_attention_kernel_used(out) == {True}
        g = torch.randn_like(out)
        got = torch.autograd.grad(out, (q, k, v), g)
        ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
        want_out = _attention_oracle(*ref_in, causal_mask(T, T, "cpu") if is_causal else mask)
        want = torch.autograd.grad(want_out, ref_in, g.double())
        torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=1e-5)
        for a, w in zip(got, want):
            torch.testing.assert_close(a.double(), w, atol=1e-5, rtol=1e-5)
    q, k, v = (x[:, :, i].transpose(1, 2).requires_grad_() for i in range(3))
    bias = torch.zeros(1, h, T, T, requires_grad=True)
    for out in (scaled_dot_product_attention(*(t.bfloat16() for t in (q, k, v)), is_causal=True)[0],
                scaled_dot_product_attention(q, k, v, bias=bias)[0]):
        assert "ShortAttentionBackward" not in _graph_nodes(out)
    monkeypatch.setattr(attention, "_SHORT", {"ok": False})  # (no kernel here: the torch path would serve)
    assert "ShortAttentionBackward" not in _graph_nodes(scaled_dot_product_attention(q, k, v, is_causal=True)[0])
    k_short = torch.randn(B, h, SHORT_KEYS, hd, requires_grad=True)
    assert "ShortAttentionBackward" in _graph_nodes(scaled_dot_product_attention(q, k_short, k_short)[0])


def test_bf16_training_attention_on_cpu(monkeypatch):
    """Under bf16 autocast on CPU, training (inputs that need gradients) keeps the softmax's inputs in fp32 and
    returns bf16. Longer keys (up to 512) take PyTorch's fused kernel in fp32 — its bf16 backward is several
    times slower there — rounding exactly its fp32 result and gradients. Short keys take ShortAttention: without
    native bf16 (ATTNLAB_NO_BF16=1 stands in) all in fp32, rounding exactly its fp32 result; with it, its
    scores and dP are fp32 products and P·V and the three gradients bf16 products, equal to the float64 oracle
    within twice the error of the fp32 result's own rounding to bf16. Inference keeps the bf16 kernel."""
    from attnlab import accel
    torch.manual_seed(0)
    native_here = accel.cpu_bf16_native()  # (False in the suite's every-fast-path-off stage)
    for Tk, native in ((200, False), (16, False), (16, True)):
        if native and not native_here:
            continue
        with monkeypatch.context() as env:
            if not native:
                env.setenv("ATTNLAB_NO_BF16", "1")
            # (the fp32 reference on ShortAttention's torch path, which bf16 inputs take: attnlab's attention
            # kernel, fp32 only, computes the same function with other roundings)
            env.setenv("ATTNLAB_OWN_KERNELS", "0")
            _check_bf16_training_attention(Tk, native)


def _check_bf16_training_attention(Tk, native):
    """One case of the test above: Tk keys, ShortAttention's bf16 products expected or not."""
    from attnlab.model.attention import ShortAttention
    q, k, v = (torch.randn(2, 4, Tk, 64).bfloat16() for _ in range(3))  # (heads of 64: bf16 products where native)
    assert ShortAttention.product_dtype(q, k, v) == (torch.bfloat16 if native else torch.float32)
    assert ShortAttention.product_dtype(q[..., :32], k[..., :32], v[..., :32]) == torch.float32  # narrower heads
    ref_in = [t.float().requires_grad_() for t in (q, k, v)]
    ref, _ = scaled_dot_product_attention(*ref_in, is_causal=True)  # the same path in fp32
    ref.backward(torch.ones_like(ref))
    torch.testing.assert_close(ref, F.scaled_dot_product_attention(*ref_in, is_causal=True), atol=1e-5, rtol=1e-5)
    train_in = [t.clone().requires_grad_() for t in (q, k, v)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = scaled_dot_product_attention(*train_in, is_causal=True)
        out.float().sum().backward()
        frozen, _ = scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out.dtype == torch.bfloat16 and all(t.grad.dtype == torch.bfloat16 for t in train_in)
    if not native:
        assert torch.equal(out, ref.detach().bfloat16())
        for got, want in zip(train_in, ref_in):
            assert torch.equal(got.grad, want.grad.bfloat16())
    else:
        oracle_in = [t.double().requires_grad_() for t in (q, k, v)]
        oracle = _attention_oracle(*oracle_in, causal_mask(Tk, Tk))
        oracle.backward(torch.ones_like(oracle))

        def err(x, want):
            return ((x.double() - want).norm() / want.norm()).item()
        assert err(out, oracle) <= 2 * err(ref.detach().bfloat16(), oracle) + 1e-6
        for got, fp32, want in zip(train_in, ref_in, oracle_in):
            assert err(got.grad, want.grad) <= 2 * err(fp32.grad.bfloat16(), want.grad) + 1e-6
    assert torch.equal(frozen, F.scaled_dot_product_attention(q, k, v, is_causal=True))  # the bf16 kernel


def test_short_attention_bf16_products_keep_fp32_scores():
    """ShortAttention's bf16 products (native bf16 CPUs): with peaked attention (scores' std ~9, where scores
    rounded to bf16 would be off by up to ~0.03 before the softmax) the output and all three gradients stay
    within 2x the error of the fp32 result's own rounding to bf16, against float64 (measured 1.0-1.5x; bf16
    scores fail it). GQA and a learned bias (T5) with its gradient take the same path."""
    from attnlab import accel
    from attnlab.model.attention import ShortAttention
    if not accel.cpu_bf16_native():
        pytest.skip("ShortAttention takes bf16 products only on a CPU with native bf16")
    torch.manual_seed(0)
    B, h, kv, T, hd = 4, 4, 2, 24, 64
    q = (torch.randn(B, T, h, hd) * 2.5).bfloat16().transpose(1, 2)   # (B, h, T, hd) in (B, T, h, hd) memory
    k = (torch.randn(B, T, kv, hd) * 2.5).bfloat16().transpose(1, 2)
    v = torch.randn(B, T, kv, hd).bfloat16().transpose(1, 2)
    bias = torch.randn(1, h, T, T).bfloat16()
    grad = torch.randn(B, h, T, hd).bfloat16()
    oracle_in = [t.double().requires_grad_() for t in (q, k, v, bias)]
    oracle = _attention_oracle(*oracle_in[:3], bias=oracle_in[3])
    oracle.backward(grad.double())
    fp32_in = [t.float().requires_grad_() for t in (q, k, v, bias)]
    fp32 = ShortAttention.apply(*fp32_in, 1 / math.sqrt(hd), False)
    fp32.backward(grad.float())
    half_in = [t.clone().requires_grad_() for t in (q, k, v, bias)]
    out = ShortAttention.apply(*half_in, 1 / math.sqrt(hd), False)
    out.backward(grad)
    assert out.dtype == torch.bfloat16 and out.transpose(1, 2).is_contiguous()

    def err(x, want):
        return ((x.double() - want).norm() / want.norm()).item()
    assert err(out, oracle) <= 2 * err(fp32.detach().bfloat16(), oracle)
    for got, f, want in zip(half_in, fp32_in, oracle_in):
        assert got.grad.dtype == torch.bfloat16
        assert err(got.grad, want.grad) <= 2 * err(f.grad.bfloat16(), want.grad)


def _own_kernels_on(monkeypatch):
    """attnlab's own CPU kernels switched on (whatever the environment says); the test skipped where they
    cannot build (not Linux, no C++ compiler or no ninja)."""
    import platform
    from attnlab import accel
    monkeypatch.delenv("ATTNLAB_OWN_KERNELS", raising=False)
    if platform.system() != "Linux" or not accel.can_build_kernels():
        pytest.skip("attnlab's own kernels are built on Linux with a C++ compiler and ninja")


def test_own_kernels_build_with_the_ninja_package_whatever_comes_first_on_path(monkeypatch, tmp_path):
    """attnlab's kernels build with the ``ninja`` package's binary, not whichever ninja PATH finds first: ninja
    keeps a hash of each command in the build folder and versions differ in it, so two processes that found
    different ninjas (a shell with the virtual environment activated and one without, as the suite's forked
    commands and its own process were) rebuilt each other's kernels every time they took turns. For the same
    reason each Python environment builds in folders of its own (two virtual environments' include paths differ)."""
    import os
    import shutil
    import subprocess
    import sys
    import threading
    import time
    from pathlib import Path
    from attnlab import accel
    ninja = pytest.importorskip("ninja")
    fake = tmp_path / "ninja"  # another ninja, first on PATH: one that fails
    fake.write_text("#!/bin/sh\necho 'the wrong ninja' >&2\nexit 1\n")
    fake.chmod(0o755)
    path = f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}"
    monkeypatch.setenv("PATH", path)
    assert shutil.which("ninja") == str(fake)
    with accel.package_ninja_first():
        found = shutil.which("ninja")
        assert found is not None and Path(found).resolve() == (Path(ninja.BIN_DIR) / "ninja").resolve()
        version = subprocess.run(["ninja", "--version"], capture_output=True, text=True)
        assert version.returncode == 0 and version.stdout.startswith(ninja.__version__.split("+")[0])
    assert os.environ["PATH"] == path  # the process's PATH as it was
    with pytest.raises(RuntimeError), accel.package_ninja_first():
        raise RuntimeError("a failed build")
    assert os.environ["PATH"] == path
    first_in = threading.Event()  # two threads' builds overlapping: the second must not restore the first's PATH

    def first():
        with accel.package_ninja_first():
            first_in.set()
            time.sleep(0.1)

    def second():  # in while the first is, out after it
        first_in.wait(5)
        with accel.package_ninja_first():
            time.sleep(0.3)

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert os.environ["PATH"] == path
    assert accel.can_build_kernels() is (accel.cxx_compiler() is not None)  # the failing ninja was not the one asked
    if accel.cxx_compiler() is not None:  # and the build itself runs with the package's ninja first
        from torch.utils import cpp_extension
        seen = []
        monkeypatch.setattr(cpp_extension, "load", lambda **kw: seen.append((shutil.which("ninja"), kw["name"],
                                                                            kw["build_directory"])))
        monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
        assert accel.build_torch_ops("attnlab_test_only", "gelu.cpp", [], "an_op_not_loaded") is None
        assert len(seen) == 1 and seen[0][1] == "attnlab_test_only"
        assert Path(seen[0][0]).resolve() == (Path(ninja.BIN_DIR) / "ninja").resolve()
        assert os.environ["PATH"] == path
        # built in a folder of this environment's own: another virtual environment (its include paths differ)
        # builds beside it instead of over it
        assert Path(seen[0][2]).is_dir() and Path(seen[0][2]).parent == tmp_path
        assert Path(seen[0][2]).name.startswith("attnlab_test_only-")
        monkeypatch.setattr(sys, "prefix", str(tmp_path / "another-venv"))
        other = accel.kernel_build_directory("attnlab_test_only")
        assert other != seen[0][2] and Path(other).parent == tmp_path
        assert accel.kernel_build_directory("attnlab_test_only") == other


def _dropout_path(monkeypatch, path):
    """``kernel``: attnlab's CPU kernel (skipped where it cannot build); ``torch``: the path without it."""
    from attnlab.model import layers
    if path == "torch":
        monkeypatch.setenv("ATTNLAB_OWN_KERNELS", "0")
    else:
        _own_kernels_on(monkeypatch)
    assert layers.fused_dropout() == (path == "kernel")  # (where the tools are, a failed build fails here)


@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_dropout_zeroes_p_of_the_values_and_keeps_the_expectation(monkeypatch, path):
    """attnlab's CPU dropout, both paths: the dropped share is p in every residue mod 4 (the torch path's
    four 16-bit lanes per draw: a biased lane would show here), kept values are scaled by 1/(1-p), the
    gradient flows through the kept ones only, the same seed gives the same mask and the next call
    another, eval is the identity."""
    from attnlab.model.layers import Dropout
    _dropout_path(monkeypatch, path)
    n = 1 << 20
    x = torch.ones(n, requires_grad=True)
    for p in (0.1, 0.3):
        drop = Dropout(p).train()
        torch.manual_seed(0)
        y = drop(x)
        kept = y != 0
        sigma = math.sqrt(p * (1 - p) / (n // 4))
        for lane in range(4):
            assert abs((~kept[lane::4]).float().mean().item() - p) < 5 * sigma, (p, lane)
        assert torch.allclose(y[kept], torch.full_like(y[kept], 1 / (1 - round(p * 65536) / 65536)))
        assert abs(y.mean().item() - 1.0) < 5 * math.sqrt(p / (1 - p) / n)  # E[dropout(x)] = x
        torch.manual_seed(0)
        assert torch.equal(drop(x), y)
        assert not torch.equal(drop(x), y)
        x.grad = None
        y.sum().backward()
        assert torch.equal(x.grad, y.detach())  # d/dx of x·mask·scale with x = 1
        assert torch.equal(drop.eval()(x), x)
    near_one = Dropout(1 - 1 / 131072).train()  # rounds to 65536/65536 dropped: PyTorch's dropout, no division by 0
    assert (near_one(x) == 0).float().mean() > 0.999


_M32 = 0xFFFFFFFF


def _lowbias32(x):  # Chris Wellons' lowbias32 on int64 tensors holding 32-bit values (products split: no overflow)
    def mul32(v, c):
        return ((((v * (c >> 16)) & 0xFFFF) << 16) + v * (c & 0xFFFF)) & _M32
    x = x ^ (x >> 16)
    x = mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _kernel_keep(n, seed, dropped):
    """The mask csrc/dropout.cpp documents, recomputed with torch's integer operations: keys k0 = lowbias32(seed_lo + 0x9E3779B9), k1 = lowbias32(seed_hi ^ k0); element
    i is kept where the top 16 bits of lowbias32(lowbias32(i_lo ^ k0) + (k1 ^ i_hi)) are >= dropped."""
    i = torch.arange(n, dtype=torch.int64)
    seed %= 1 << 64  # (the op takes the seed as a signed 64-bit integer)
    k0 = _lowbias32(torch.tensor(((seed & _M32) + 0x9E3779B9) & _M32))
    k1 = _lowbias32(torch.tensor(seed >> 32) ^ k0)
    inner = _lowbias32((i & _M32) ^ k0)
    return (_lowbias32((inner + ((i >> 32) ^ k1)) & _M32) >> 16) >= dropped


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dropout_kernel_is_the_hash_it_documents(monkeypatch, dtype):
    """Every element of ``attnlab::dropout`` against the hash recomputed here, for sizes around its blocks
    of 512 and a tail, negative and large seeds, a non-contiguous input; the kept values are x·scale
    rounded once to the dtype, the dropped ones 0; 1 thread and 2 give the same result."""
    _dropout_path(monkeypatch, "kernel")
    g = torch.Generator().manual_seed(0)
    for n, seed, dropped in ((1, 7, 6554), (511, -1, 6554), (512, 2 ** 63 - 1, 19661), (513, -2 ** 63, 32768),
                             (100_003, 0x1234_5678_9ABC_DEF0, 6554)):
        x = torch.randn(n, generator=g).to(dtype)
        scale = 65536 / (65536 - dropped)
        got = torch.ops.attnlab.dropout(x, seed, dropped, scale)
        keep = _kernel_keep(n, seed, dropped)
        assert torch.equal(got, torch.where(keep, x.float() * scale, 0.0).to(dtype)), (n, seed)
    x = torch.randn(64, 48, generator=g).to(dtype)
    strided = torch.ops.attnlab.dropout(x.t(), 3, 6554, 1.5)  # (a view: the kernel reads it in x.t()'s order)
    assert torch.equal(strided, torch.ops.attnlab.dropout(x.t().contiguous(), 3, 6554, 1.5))
    big = torch.randn(300_000, generator=g).to(dtype)
    threads, outs = torch.get_num_threads(), []
    try:
        for n_threads in (1, 4):
            torch.set_num_threads(n_threads)
            outs.append(torch.ops.attnlab.dropout(big, 99, 6554, 1.25))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(*outs)


def test_dropout_kernel_bits_are_uniform_and_independent(monkeypatch):
    """The kernel's 16-bit uniforms, seen through thresholds: P(dropped) = dropped/65536 for every
    sixteenth of the range; neighbouring elements and two seeds' masks uncorrelated."""
    _dropout_path(monkeypatch, "kernel")
    n = 1 << 20
    ones = torch.ones(n)
    for k in range(1, 16):
        kept = torch.ops.attnlab.dropout(ones, 11, k * 4096, 1.0) != 0
        p = k / 16
        assert abs(1 - kept.float().mean().item() - p) < 5 * math.sqrt(p * (1 - p) / n), k
    a = (torch.ops.attnlab.dropout(ones, 1, 32768, 1.0) != 0).float() - 0.5
    b = (torch.ops.attnlab.dropout(ones, 2, 32768, 1.0) != 0).float() - 0.5
    bound = 5 / math.sqrt(n)
    assert abs((a[1:] * a[:-1]).mean().item() * 4) < bound  # lag 1
    assert abs((a[2:] * a[:-2]).mean().item() * 4) < bound  # lag 2
    assert abs((a * b).mean().item() * 4) < bound  # seeds 1 and 2
    # seeds 1 and 2 differ in two bits: with the seed xor-ed straight onto the index, seed 2's mask was seed
    # 1's with the indices xor 3; mixed into keys first, it is not
    assert abs((b * a[torch.arange(n) ^ 3]).mean().item() * 4) < bound


def test_dropout_kernel_gradients_of_any_order(monkeypatch):
    """y = keep ⊙ x · s: dy/dx applies the same mask to the incoming gradient, and that gradient's own
    gradient again (the backward is the kernel, with the forward's seed); bf16 in, bf16 gradient out."""
    from attnlab.model.layers import Dropout
    _dropout_path(monkeypatch, "kernel")
    drop = Dropout(0.25).train()
    x = torch.randn(3, 1000, requires_grad=True)
    y = drop(x)
    mask = y != 0  # (x is never exactly 0 here)
    g = torch.randn(3, 1000, requires_grad=True)
    (dx,) = torch.autograd.grad(y, x, g, create_graph=True)
    assert torch.equal(dx, torch.where(mask, g.detach() * (4 / 3), 0.0))
    h = torch.randn(3, 1000)
    (dg,) = torch.autograd.grad(dx, g, h)
    assert torch.equal(dg, torch.where(mask, h * (4 / 3), 0.0))
    bf = torch.randn(4, 300, dtype=torch.bfloat16, requires_grad=True)
    out = drop(bf)
    out.backward(torch.ones_like(out))
    assert bf.grad.dtype == torch.bfloat16 and torch.equal(bf.grad != 0, out != 0)
    # torch.func's transforms: grad, and a forward-mode tangent through the same mask
    torch.manual_seed(3)
    fg = torch.func.grad(lambda t: (drop(t) * h[0]).sum())(x.detach()[0])
    torch.manual_seed(3)
    fy = drop(x.detach()[0])
    assert torch.equal(fg, torch.where(fy != 0, h[0] * (4 / 3), 0.0))
    torch.manual_seed(3)
    fy2, tangent = torch.func.jvp(drop, (x.detach()[0],), (h[0],))
    assert torch.equal(fy2, fy) and torch.equal(tangent, torch.where(fy != 0, h[0] * (4 / 3), 0.0))


def test_dropout_kernel_check_survives_other_defaults(monkeypatch):
    """The kernel's first-use check runs in fp32 on the CPU whatever the process's defaults (a float64
    default dtype, a meta default device), and the layer draws its seed on the CPU."""
    from attnlab.model import layers
    _dropout_path(monkeypatch, "kernel")
    monkeypatch.setattr(layers, "_FUSED", {})
    try:
        torch.set_default_dtype(torch.float64)
        torch.set_default_device("meta")
        assert layers.fused_dropout()
        y = layers.Dropout(0.5).train()(torch.ones(1000, dtype=torch.float32, device="cpu"))
    finally:
        torch.set_default_dtype(torch.float32)
        torch.set_default_device(None)
    assert y.device.type == "cpu" and 350 < int((y == 0).sum()) < 650
    from attnlab.model import attention
    monkeypatch.setattr(layers, "_GELU", {})  # the GELU and attention kernels' checks too
    monkeypatch.setattr(attention, "_SHORT", {})
    try:
        torch.set_default_dtype(torch.float64)
        torch.set_default_device("meta")
        assert layers.fused_gelu()
        assert attention.fused_short_attention()
    finally:
        torch.set_default_dtype(torch.float32)
        torch.set_default_device(None)


def test_gelu_kernel_and_its_slope_match_float64(monkeypatch):
    """attnlab's GELU kernel (``layers.gelu`` while training on CPU in fp32): GELU and its gradient equal
    float64's ``F.gelu`` to fp32 accuracy over the whole range (the tails, where erfc is tiny, and past the exp's
    clamp), NaN stays NaN, a non-contiguous input is read right; the backward is the kept slope times the
    gradient, and a second derivative is refused, not wrong. Without gradients it is ``F.gelu`` itself."""
    from attnlab.model import layers
    _dropout_path(monkeypatch, "kernel")
    assert layers.fused_gelu()
    x = torch.cat([torch.linspace(-20, 20, 200_001), torch.randn(50_000) * 3, torch.tensor([0.0, -0.0, 1e-30, -1e-30])])
    x = x.requires_grad_()
    y = layers.gelu(x)
    assert y.grad_fn.name().endswith("::GeluWithSlope>")  # (the kernel's path: attnlab::gelu_training's C++ node)
    dy = torch.randn_like(x)
    y.backward(dy)
    x64 = x.detach().double().requires_grad_()
    y64 = F.gelu(x64)
    y64.backward(dy.double())
    assert torch.allclose(y.double(), y64, rtol=2e-6, atol=1e-6), (y.double() - y64).abs().max()
    assert torch.allclose(x.grad.double(), x64.grad, rtol=2e-6, atol=1e-6), (x.grad.double() - x64.grad).abs().max()
    # no worse than PyTorch's own fp32 GELU against float64
    assert (y.double() - y64).abs().max() <= 2 * (F.gelu(x.detach()).double() - y64).abs().max()
    nan = layers.gelu(torch.tensor([float("nan"), 1.0], requires_grad=True))
    assert nan[0].isnan() and not nan[1].isnan()
    wide = torch.randn(64, 48).t().requires_grad_()  # (48, 64), not contiguous: F.gelu (no copy, no slope kept)
    assert torch.equal(layers.gelu(wide), F.gelu(wide)) and type(layers.gelu(wide).grad_fn).__name__ == "GeluBackward0"
    square = torch.randn(48, 64, requires_grad=True)
    (g,) = torch.autograd.grad(layers.gelu(square).pow(2).sum(), square, create_graph=True)
    with pytest.raises(RuntimeError, match="no second derivative"):
        g.sum().backward()
    with torch.no_grad():
        assert torch.equal(layers.gelu(x), F.gelu(x))


def test_gelu_kernel_first_use_inside_checkpoint_or_no_grad_or_fake_tensors(monkeypatch):
    """The kernel's first-use check in a fresh process: asked first inside ``torch.utils.checkpoint`` (whose
    saved-tensor hooks once made a check through autograd recompute the forward, which asked again under the
    build's lock: a hang) and under ``no_grad`` (where that check found no gradient and cached "no kernel");
    the operators' fake kernels let fake tensors trace the model's FFN and short-key attention (forward and backward),
    the packed self-attention's too."""
    import os
    import subprocess
    import sys
    _dropout_path(monkeypatch, "kernel")
    code = ("import torch, torch.utils.checkpoint as cp; from attnlab.model import layers\n"
            "x = torch.randn(8, 16, requires_grad=True)\n"
            "y = cp.checkpoint(lambda t: layers.gelu(t * 2), x, use_reentrant=False)\n"
            "y.sum().backward()\n"
            "ok = layers.fused_gelu() and type(y.grad_fn).__name__ != 'GeluBackward0'\n"
            "layers._GELU.clear()\n"
            "with torch.no_grad():\n"
            "    ok = ok and layers.fused_gelu()\n"
            "from attnlab.model import attention\n"
            "ok = ok and attention.fused_short_attention()\n"
            "from torch._subclasses.fake_tensor import FakeTensorMode\n"
            "with FakeTensorMode():\n"
            "    f = layers.gelu(torch.randn(4, 32, requires_grad=True))\n"
            "    qkv = [torch.randn(2, 4, 6, 8, requires_grad=True) for _ in range(3)]\n"
            "    a, _ = attention.scaled_dot_product_attention(*qkv, is_causal=True)\n"
            "    a.sum().backward()\n"
            "    ok = ok and tuple(a.shape) == (2, 4, 6, 8) and a.grad_fn.kernel and tuple(qkv[0].grad.shape) == (2, 4, 6, 8)\n"
            "    packed = torch.randn(2, 6, 48, requires_grad=True)\n"  # (the fused projection's self-attention)
            "    p = torch.ops.attnlab.packed_self_attention(packed, 2, 2, 0.3, True)\n"
            "    p.sum().backward()\n"
            "    ok = ok and tuple(p.shape) == (2, 6, 16) and tuple(packed.grad.shape) == (2, 6, 48)\n"
            "print(ok, tuple(f.shape), x.grad.abs().sum().item() > 0)\n")
    env = {k: v for k, v in os.environ.items() if k != "ATTNLAB_OWN_KERNELS"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == ["True", "(4,", "32)", "True"], res.stdout


@pytest.mark.parametrize("preset", ["shakespeare-char", "vit-mnist"])
def test_gelu_kernel_trains_the_model_as_f_gelu_does(monkeypatch, preset):
    """A model whose FFN is GELU: the loss and every gradient with attnlab's kernel equal those of the torch
    path (ATTNLAB_OWN_KERNELS=0: ``F.gelu``) to fp32 rounding."""
    from attnlab.model import layers
    torch.manual_seed(0)
    cfg = get_preset(preset, **({"vocab_size": 40} if preset == "shakespeare-char" else {}))
    model = build_model(cfg).train()
    if cfg.family == "decoder-only":
        batch, run = torch.randint(1, 40, (3, 16)), lambda m, b: F.cross_entropy(m(b).flatten(0, 1), b.flatten())
    else:
        batch, run = torch.randn(3, 1, 28, 28), lambda m, b: m(b).logsumexp(-1).mean()
    _dropout_path(monkeypatch, "kernel")
    kernel_calls, real_gelu = [], torch.ops.attnlab.gelu_training
    monkeypatch.setattr(torch.ops.attnlab, "gelu_training", lambda x: kernel_calls.append(x.shape) or real_gelu(x))
    grads = {}
    for path in ("kernel", "torch"):
        _dropout_path(monkeypatch, path)
        assert layers.fused_gelu() == (path == "kernel")
        model.zero_grad(set_to_none=True)
        loss = run(model, batch)
        loss.backward()
        grads[path] = (loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None])
        assert len(kernel_calls) == (cfg.n_decoder_layers if cfg.family == "decoder-only" else cfg.n_encoder_layers)  # one per FFN, kernel path only
    _assert_same_training(grads["kernel"], grads["torch"])


@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_residual_dropout_add_is_dropout_then_add(monkeypatch, path):
    """``Dropout.add_to(residual, x)``, the residual connection: residual + dropout(x) in the wider dtype, bit for
    bit what dropout, a cast and an add give (the kernel's ``attnlab::dropout_add`` does it in one pass), for
    every pair of dtypes the model meets (fp32 stream with a bf16/fp16 sublayer under autocast, or one dtype);
    the residual's gradient is dy, x's the same dropout of dy in x's dtype; a forward-mode tangent too; shapes
    that broadcast take the unfused path."""
    from attnlab.model.layers import Dropout
    _dropout_path(monkeypatch, path)
    drop = Dropout(0.2).train()
    for x_dtype, r_dtype in ((torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                             (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32),
                             (torch.float32, torch.bfloat16)):
        x = torch.randn(5, 7, 130).to(x_dtype).requires_grad_()
        r = torch.randn(5, 7, 130).to(r_dtype).requires_grad_()
        torch.manual_seed(1)
        y = drop.add_to(r, x)
        torch.manual_seed(1)
        dropped = drop(x.detach())
        out_dtype = torch.promote_types(x_dtype, r_dtype)
        assert y.dtype == out_dtype
        assert torch.equal(y, r.detach().to(out_dtype) + dropped.to(out_dtype)), (x_dtype, r_dtype)
        g = torch.randn(5, 7, 130).to(out_dtype)
        dx, dr = torch.autograd.grad(y, (x, r), g)
        assert dr.dtype == r_dtype and torch.equal(dr, g.to(r_dtype))
        assert dx.dtype == x_dtype
        assert torch.equal(dx, torch.where(dropped != 0, g.to(x_dtype) * (65536 / (65536 - 13107)), 0.0).to(x_dtype))
    x, r, t = torch.randn(3, 50), torch.randn(3, 50), torch.randn(3, 50)
    torch.manual_seed(2)
    y, tangent = torch.func.jvp(drop.add_to, (r, x), (torch.zeros_like(r), t))
    torch.manual_seed(2)
    assert torch.equal(y, r + drop(x)) and torch.equal(tangent, torch.where(y != r, t * (65536 / (65536 - 13107)), 0.0))
    from torch.autograd import forward_ad  # a tangent for x only, the output fp32 from a bf16 x: an fp32 tangent
    xb = x.bfloat16()
    with forward_ad.dual_level():
        torch.manual_seed(2)
        dual = drop.add_to(r, forward_ad.make_dual(xb, t.bfloat16()))
        y, tangent = forward_ad.unpack_dual(dual)
    torch.manual_seed(2)
    assert torch.equal(y, r + drop(xb).float())
    assert tangent.dtype == torch.float32 and torch.equal(tangent, drop_like(y != r, t.bfloat16()).float())
    # second derivatives, and gradients where only one input wants one
    x2 = torch.randn(3, 50, requires_grad=True)
    y = drop.add_to(r, x2)
    g = torch.randn(3, 50, requires_grad=True)
    (dx,) = torch.autograd.grad(y, x2, g, create_graph=True)
    (dg,) = torch.autograd.grad(dx, g, torch.ones(3, 50))
    assert torch.equal(dg, drop_like(dx != 0, torch.ones(3, 50)))
    r2 = torch.randn(3, 50, requires_grad=True)
    (dr,) = torch.autograd.grad(drop.add_to(r2, x), r2, g.detach())
    assert torch.equal(dr, g.detach())
    torch.manual_seed(3)
    wide = drop.add_to(torch.randn(4, 1, 50), x)  # (a residual that broadcasts: the unfused path)
    assert wide.shape == (4, 3, 50)
    assert torch.equal(drop.eval().add_to(r, x), r + x)


def drop_like(kept, t, p=0.2):
    """t through the mask ``kept`` of a Dropout(p), scaled as attnlab scales (p rounded to a multiple of 2⁻¹⁶)."""
    return torch.where(kept, t * (65536 / (65536 - round(p * 65536))), 0.0).to(t.dtype)


def test_residual_connection_takes_any_module_as_its_dropout():
    """Model surgery that replaces a SublayerConnection's dropout (by nn.Identity, nn.Dropout) keeps working:
    the module is called, the residual added."""
    from torch import nn
    from attnlab.model.layers import SublayerConnection
    conn = SublayerConnection(TransformerConfig(vocab_size=11, d_model=16, n_heads=2, d_ff=32, dropout=0.1)).train()
    conn.dropout = nn.Identity()
    x = torch.randn(2, 3, 16)
    assert torch.equal(conn(x, lambda t: 2 * t), conn.norm(x + 2 * x) if not conn.pre_norm else x + 2 * conn.norm(x))


def test_dropout_add_kernel_is_the_hash_it_documents(monkeypatch):
    """``attnlab::dropout_add`` against the hash recomputed here (sizes around the blocks, a tail, strided
    inputs) and its errors: a residual of another shape or a narrower dtype than x is refused, by name."""
    _dropout_path(monkeypatch, "kernel")
    g = torch.Generator().manual_seed(0)
    for n, seed, dropped in ((1, 7, 6554), (513, -2 ** 63, 32768), (100_003, 0x1234_5678_9ABC_DEF0, 6554)):
        x, r = torch.randn(n, generator=g).bfloat16(), torch.randn(n, generator=g)
        scale = 65536 / (65536 - dropped)
        keep = _kernel_keep(n, seed, dropped)
        want = r + torch.where(keep, x.float() * scale, 0.0).bfloat16().float()
        assert torch.equal(torch.ops.attnlab.dropout_add(x, r, seed, dropped, scale), want), (n, seed)
    x, r = torch.randn(64, 48, generator=g), torch.randn(48, 64, generator=g)
    assert torch.equal(torch.ops.attnlab.dropout_add(x.t(), r, 3, 6554, 1.5),
                       torch.ops.attnlab.dropout_add(x.t().contiguous(), r, 3, 6554, 1.5))
    h = torch.randn(1000, generator=g).half()  # the fp16 residual branch
    keep = _kernel_keep(1000, 5, 6554)
    want = (h.float() + torch.where(keep, h.float() * 1.25, 0.0).half().float()).half()
    assert torch.equal(torch.ops.attnlab.dropout_add(h, h, 5, 6554, 1.25), want)
    with pytest.raises(RuntimeError, match="residual of x's shape"):
        torch.ops.attnlab.dropout_add(x, r, 3, 6554, 1.5)
    with pytest.raises(RuntimeError, match="the wider"):
        torch.ops.attnlab.dropout_add(x, r.t().bfloat16(), 3, 6554, 1.5)


def test_short_key_attention_traces_without_graph_breaks():
    """ShortAttention (forward and its hand-written backward) is traced whole by torch.compile: a graph break
    there would keep inductor from fusing around it, the reason it is taken under compile too."""
    import torch._dynamo
    from attnlab import accel
    if not accel.can_compile("cpu"):
        pytest.skip("torch.compile cannot generate CPU code here")
    B, h, T, hd = 2, 4, 16, 8

    def step(qkv):
        q, k, v = (t.view(B, T, h, hd).transpose(1, 2) for t in qkv.split(h * hd, -1))
        return scaled_dot_product_attention(q, k, v, is_causal=True)[0].sum()

    qkv = torch.randn(B, T, 3 * h * hd, requires_grad=True)
    explained = torch._dynamo.explain(step)(qkv)
    assert explained.graph_break_count == 0, explained.break_reasons
    if accel.cpu_bf16_native():  # bf16 inputs there take bf16 products: the CPU check is a constant to the trace
        torch._dynamo.reset()
        B, h, T, hd = 2, 2, 16, 64
        explained = torch._dynamo.explain(step)(torch.randn(B, T, 3 * h * hd, dtype=torch.bfloat16, requires_grad=True))
        assert explained.graph_break_count == 0, explained.break_reasons
