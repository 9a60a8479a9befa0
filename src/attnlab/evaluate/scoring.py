"""Held-out scores of trained models: language-model loss, class predictions, masked-LM loss.
(Translation is scored with sacreBLEU/chrF in ``metrics.py``.)"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..data.batching import by_length, padded
from ..data.encoding import mask_tokens, n_special
from ..data.readers import DataError
from ..model import eval_mode


@torch.no_grad()
def lm_loss(model, ids: torch.Tensor, block_size: int, device, bf16: bool = False, max_blocks: int = 0,
            batch_size: int = 32) -> dict:
    """Loss over consecutive blocks of ``block_size`` tokens (every token scored once, not sampled)."""
    n_blocks = (len(ids) - 1) // block_size
    if max_blocks:
        n_blocks = min(n_blocks, max_blocks)
    if n_blocks == 0:
        raise DataError(f"evaluation text has {len(ids)} tokens, fewer than one block of {block_size}")
    total, count = 0.0, 0
    with eval_mode(model):
        for s in range(0, n_blocks, batch_size):
            starts = range(s * block_size, min(n_blocks, s + batch_size) * block_size, block_size)
            x = torch.stack([ids[i: i + block_size] for i in starts]).to(device)
            y = torch.stack([ids[i + 1: i + 1 + block_size] for i in starts]).to(device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                logits = model(x)
            total += F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1),
                                     reduction="sum").item()
            count += y.numel()
    loss = total / count
    return {"val_loss": round(loss, 4), "val_ppl": round(math.exp(loss), 3), "score": -loss, "tokens": count}


@torch.no_grad()
def predict_classes(model, encoded: list[list[int]], device, bf16: bool = False, batch_size: int = 64):
    """(predicted class ids, probabilities of the prediction) for already tokenized texts."""
    pred, prob = [0] * len(encoded), [0.0] * len(encoded)
    with eval_mode(model):
        for idx in by_length(encoded, batch_size):
            x, mask = padded([encoded[i] for i in idx], model.config.pad_id)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                p = model.classify(x.to(device), mask.to(device)).float().softmax(-1)
            top = p.max(-1)
            for j, i in enumerate(idx):
                pred[i], prob[i] = int(top.indices[j]), float(top.values[j])
    return pred, prob


@torch.no_grad()
def mlm_scores(model, encoded: list[list[int]], tok, device, bf16: bool = False, seed: int = 1,
               batch_size: int = 64) -> dict:
    """Masked-LM loss and accuracy on the chosen positions, with masks drawn from a fixed seed (so
    evaluations of different checkpoints see the same corruption)."""
    g = torch.Generator().manual_seed(seed)
    total, correct, count = 0.0, 0, 0
    with eval_mode(model):
        for s in range(0, len(encoded), batch_size):
            x, is_token = padded(encoded[s: s + batch_size], tok.pad_id)
            inputs, labels = mask_tokens(x, is_token, tok.mask_id, tok.vocab_size, n_special(tok), g)
            targets = labels != -100
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                logits = model.mlm_logits(model(inputs.to(device), is_token.to(device))[targets.to(device)]).float()
            y = labels[targets].to(device)
            total += F.cross_entropy(logits, y, reduction="sum").item()
            correct += int((logits.argmax(-1) == y).sum())
            count += len(y)
    loss = total / max(count, 1)
    return {"dev_mlm_loss": round(loss, 4), "dev_mlm_accuracy": round(correct / max(count, 1), 4),
            "dev_mlm_ppl": round(math.exp(min(loss, 50)), 3), "score": -loss, "tokens": count}


__all__ = ["lm_loss", "predict_classes", "mlm_scores"]
