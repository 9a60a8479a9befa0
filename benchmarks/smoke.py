"""``--smoke`` for the quality recipes (classification.py, translation_quality.py, shakespeare_nanogpt.py):
the recipe's own flags, run for a couple of updates, so that the test suite can check a recipe still
runs end to end (train, evaluate, score) without spending its minutes on it."""

SMOKE_STEPS = 2


def smoke_flags(flags: list[str], steps: int = SMOKE_STEPS) -> list[str]:
    """``flags`` (an ``attnlab train`` command or part of one) for a smoke run: ``steps`` updates,
    evaluated at the last, warmup 1, 20 dev sentences scored; a flag the recipe does not pass stays unpassed."""
    values = {"--max-steps": steps, "--eval-every": steps, "--warmup": 1, "--eval-sentences": 20}
    flags = list(flags)
    for i, f in enumerate(flags[:-1]):
        if f in values:
            flags[i + 1] = str(values[f])
    return flags
