"""sacreBLEU and chrF with the tokenizer the target language needs."""

from __future__ import annotations

import re

_CJK = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")


def bleu_tokenizer_for(references: list[str]) -> str:
    """'zh' for Chinese (or Japanese) targets, which have no spaces between words: sacreBLEU then
    splits CJK characters; '13a' (the WMT standard) otherwise."""
    sample = references[:200]
    cjk = sum(bool(_CJK.search(r)) for r in sample)
    return "zh" if sample and cjk > len(sample) / 2 else "13a"


def corpus_scores(hypotheses: list[str], references: list[str], tokenize: str | None = None) -> dict:
    import sacrebleu
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references")
    tokenize = tokenize or bleu_tokenizer_for(references)
    bleu = sacrebleu.corpus_bleu(hypotheses, [references], tokenize=tokenize)
    chrf = sacrebleu.corpus_chrf(hypotheses, [references])
    return {"bleu": round(bleu.score, 2), "chrf": round(chrf.score, 2), "n": len(hypotheses),
            "tokenize": tokenize, "signature": f"nrefs:1|tok:{tokenize}|sacrebleu:{sacrebleu.__version__}"}
