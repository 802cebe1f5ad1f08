"""Non-finite-loss injection for the training tests: one step function's loss made NaN."""
from __future__ import annotations


def poison_loss(monkeypatch, module, name: str, at_call: int):
    """Replace module.<name> (a step function returning (loss, a)) by one whose loss is NaN at
    its at_call-th call (1-based) and unchanged otherwise.  Returns (calls, real): the call
    counter ({"n": calls so far}) and the original function (to put back)."""
    real = getattr(module, name)
    calls = {"n": 0}

    def poisoned(*a, **k):
        loss, z = real(*a, **k)
        calls["n"] += 1
        return (loss * float("nan") if calls["n"] == at_call else loss), z

    monkeypatch.setattr(module, name, poisoned)
    return calls, real
