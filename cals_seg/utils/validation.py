"""Input checks shared by the losses, the meters and temperature scaling.

One copy of each check, so a user sees the same message whichever entry point rejects the input.
"""

from __future__ import annotations

from torch import Tensor


def check_finite(logits: Tensor, maxima: Tensor | None = None) -> None:
    """Raise ``ValueError`` if ``logits`` holds NaN or +-inf.

    Cheap path: NaN and +inf show in the per-position maximum (pass it when the caller already
    has it, else it is computed here), -inf in the per-position minimum, and any of them makes
    the sum of both non-finite; the full count is only taken when that sum is not finite (it can
    also overflow on huge but finite logits, which then pass).

    Shape:
        - logits: ``(N, K, P)``; maxima: ``(N, P)`` (or ``(N, 1, P)``).
    """
    if maxima is None:
        maxima = logits.amax(dim=1)
    total = logits.amin(dim=1).add_(maxima.reshape(logits.shape[0], logits.shape[2])).sum()
    if not bool(total.isfinite()):
        bad = int((~logits.isfinite()).sum())
        if bad:
            raise ValueError(
                f"Expected `logits` to be finite, but got {bad} non-finite values (NaN or inf)."
            )
