"""Parity with torch.nn.Transformer (an independent implementation) with copied weights."""
import math

import pytest
import torch
from torch import nn

from attnlab import TransformerConfig, build_model

D, H, FF, V = 32, 4, 64, 50


def copy_weights(ours, ref: nn.Transformer):
    d = D
    with torch.no_grad():
        for a, b in zip(ours.encoder.layers, ref.encoder.layers):
            a.self_attn.qkv_proj.weight.copy_(b.self_attn.in_proj_weight)
            a.self_attn.qkv_proj.bias.copy_(b.self_attn.in_proj_bias)
            a.self_attn.out_proj.load_state_dict(b.self_attn.out_proj.state_dict())
            a.feed_forward.w_in.load_state_dict(b.linear1.state_dict())
            a.feed_forward.w_out.load_state_dict(b.linear2.state_dict())
            a.attn_residual.norm.load_state_dict(b.norm1.state_dict())
            a.ffn_residual.norm.load_state_dict(b.norm2.state_dict())
        for a, b in zip(ours.decoder.layers, ref.decoder.layers):
            a.self_attn.qkv_proj.weight.copy_(b.self_attn.in_proj_weight)
            a.self_attn.qkv_proj.bias.copy_(b.self_attn.in_proj_bias)
            a.self_attn.out_proj.load_state_dict(b.self_attn.out_proj.state_dict())
            a.cross_attn.q_proj.weight.copy_(b.multihead_attn.in_proj_weight[:d])
            a.cross_attn.q_proj.bias.copy_(b.multihead_attn.in_proj_bias[:d])
            a.cross_attn.kv_proj.weight.copy_(b.multihead_attn.in_proj_weight[d:])
            a.cross_attn.kv_proj.bias.copy_(b.multihead_attn.in_proj_bias[d:])
            a.cross_attn.out_proj.load_state_dict(b.multihead_attn.out_proj.state_dict())
            a.feed_forward.w_in.load_state_dict(b.linear1.state_dict())
            a.feed_forward.w_out.load_state_dict(b.linear2.state_dict())
            a.attn_residual.norm.load_state_dict(b.norm1.state_dict())
            a.cross_residual.norm.load_state_dict(b.norm2.state_dict())
            a.ffn_residual.norm.load_state_dict(b.norm3.state_dict())
        ours.encoder.norm.load_state_dict(ref.encoder.norm.state_dict())
        ours.decoder.norm.load_state_dict(ref.decoder.norm.state_dict())


def reference_positions(T, d):
    pe = torch.zeros(T, d)
    for pos in range(T):
        for i in range(0, d, 2):
            pe[pos, i] = math.sin(pos / 10000 ** (i / d))
            pe[pos, i + 1] = math.cos(pos / 10000 ** (i / d))
    return pe


@pytest.mark.parametrize("norm_first", [False, True])
def test_matches_torch_nn_transformer(norm_first):
    cfg = TransformerConfig(vocab_size=V, d_model=D, n_heads=H, n_encoder_layers=2, n_decoder_layers=2,
                            d_ff=FF, dropout=0.0, norm_placement="pre" if norm_first else "post",
                            final_norm=True)  # nn.Transformer always has final encoder/decoder norms
    ours = build_model(cfg).eval()
    ref = nn.Transformer(D, H, 2, 2, FF, dropout=0.0, batch_first=True, norm_first=norm_first).eval()
    copy_weights(ours, ref)

    B, S, T = 3, 7, 6
    src = torch.randint(4, V, (B, S))
    tgt = torch.randint(4, V, (B, T))
    src_len = torch.tensor([7, 4, 5])
    tgt_len = torch.tensor([6, 6, 3])
    src_mask = torch.arange(S)[None] < src_len[:, None]  # True = token (attnlab's convention)
    tgt_mask = torch.arange(T)[None] < tgt_len[:, None]

    with torch.no_grad():
        logits = ours(src, tgt, src_mask, tgt_mask)
        # The oracle: nn.Embedding ×√d + positions computed by the textbook formula.
        emb = ours.src_embed.token.weight
        x_src = emb[src] * math.sqrt(D) + reference_positions(S, D)
        x_tgt = emb[tgt] * math.sqrt(D) + reference_positions(T, D)
        out = ref(x_src, x_tgt, tgt_mask=nn.Transformer.generate_square_subsequent_mask(T),
                  src_key_padding_mask=~src_mask, tgt_key_padding_mask=~tgt_mask,
                  memory_key_padding_mask=~src_mask, tgt_is_causal=True)
        ref_logits = out @ emb.T
    assert (logits - ref_logits).abs().max().item() <= 1e-5
