"""Shared math of the margin-based losses (MbLS, CALS-HR, CALS-ALM).

Notation (docs/design.md, "The loss"): logits ``l (N, K, S)``, valid positions ``V``,

    d_ik = max_j l_ij - l_ik        (the max is NOT detached)
    z_ik = d_ik / m - 1              (normalised constraint, z <= 0 is satisfied)

:func:`class_penalty` returns ``(1 / (|V| K)) * sum_{i in V} sum_k f_k(z_ik)`` with an analytic
backward: with ``g_ik = f_k'(z_ik) / (|V| K m)`` on valid positions (0 elsewhere),

    d penalty / d l_ik = -g_ik + [k == argmax_j l_ij] * sum_c g_ic

(a tie at the max shares ``sum_c g_ic`` equally between the tied classes, as autograd of
``amax`` does). Backward keeps only the logits (already alive for the cross-entropy) and the
``(N, 1, S)`` map of per-position maxima, not even an arg-max index (``max`` with indices
over the class dimension is ten times slower than ``amax`` on CPU). Both passes walk the
logits in blocks of about :data:`BLOCK_ELEMENTS` elements: every temporary is block-sized (it
stays in cache and is recycled by the allocator instead of being page-faulted in at logits
size), and the only logits-sized allocation is the gradient that backward returns.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from cals_seg.losses._base import autocast_off

ElementFn = Callable[[Tensor], Tensor]

BLOCK_ELEMENTS = 1 << 18  # ~1 MiB of float32 per temporary and thread: CPU cache-sized
# On a GPU a block is a kernel launch per operation, and a 1 MiB block is launch-bound. Measured
# on an H100 (docs/gpu/, DeepLabV3-ResNet50 bf16 step at 8 x 512 x 512): CALS-ALM / CE = 2.34x
# with CPU-sized blocks, 1.12x with 16 blocks, 1.05x with 4; the loss's peak memory was CE's plus
# one logits tensor for 16, 8, 4 and 2 blocks alike (the block temporaries are freed before the
# gradient is allocated). So four blocks (at least 4M elements each).
GPU_BLOCKS = 4
GPU_MIN_BLOCK = 1 << 22


def default_block(logits: Tensor) -> int:
    """Elements per block for ``logits``: :data:`BLOCK_ELEMENTS` per torch thread on the CPU
    (each thread's share stays cache-sized, and with more threads there are fewer operations,
    each a parallel region whose threads all wait for the slowest), a :data:`GPU_BLOCKS`-th
    of the tensor (at least :data:`GPU_MIN_BLOCK`) on an accelerator."""
    if logits.device.type == "cpu":
        return BLOCK_ELEMENTS * max(1, torch.get_num_threads())
    return max(GPU_MIN_BLOCK, -(-logits.numel() // GPU_BLOCKS))


def blocks(logits: Tensor, block: int | None = None) -> Iterator[tuple[slice, slice]]:
    """``(images, positions)`` slices that tile ``logits (N, K, S)`` in blocks of about ``block``
    (default :func:`default_block`) elements: whole images when ``K * S`` is small
    (classification), spatial strips otherwise."""
    if torch.compiler.is_compiling():
        # Under torch.compile the whole tensor is one block: inductor fuses the elementwise
        # chain into the reductions, so no temporary is materialised, and a Python loop over
        # a symbolic batch size would specialise it.
        yield slice(None), slice(None)
        return
    block = default_block(logits) if block is None else block
    n, k, s = logits.shape
    per_image = k * s
    if per_image >= block:
        step = max(1, block // k)
        for i in range(n):
            for j in range(0, s, step):
                yield slice(i, i + 1), slice(j, j + step)
    else:
        step = max(1, block // per_image)
        for i in range(0, n, step):
            yield slice(i, i + step), slice(None)


def _constraint(
    logits: Tensor, mx: Tensor, margin: float | Tensor, out: Tensor | None = None
) -> Tensor:
    if torch.is_tensor(margin):  # a 0-dim margin (under torch.compile: no recompilation)
        return torch.sub(mx, logits, out=out).div_(margin).sub_(1.0)
    # z = (mx / m - 1) - l / m in one pass over the logits.
    return torch.add(mx.mul(1.0 / margin).sub_(1.0), logits, alpha=-1.0 / margin, out=out)


def class_sums(
    logits: Tensor, valid: Tensor, margin: float, fns: list[ElementFn], maxima: Tensor | None = None
) -> list[Tensor]:
    """Per-class sums over valid positions of ``f(z)`` for each ``f`` in ``fns``, in float64.

    Args:
        logits: ``(N, K, S)``.
        valid: ``(N, S)`` bool.
        margin: m.
        fns: elementwise functions of ``z``; each gets its own copy of the block's ``z`` and may
            work in place.
        maxima: optional ``(N, 1, S)`` output filled with ``max_j l_j``.

    Returns:
        One ``(K,)`` float64 tensor per function.
    """
    k = logits.shape[1]
    sums = [torch.zeros(k, dtype=torch.float64, device=logits.device) for _ in fns]
    for im, pos in blocks(logits):
        x = logits[im, :, pos]
        mx = x.amax(dim=1, keepdim=True)
        if maxima is not None:
            maxima[im, :, pos] = mx
        void = ~valid[im, pos].unsqueeze(1)  # (n, 1, s)
        z = _constraint(x, mx, margin)
        for f, total in zip(fns, sums, strict=True):
            values = f(z.clone() if len(fns) > 1 else z)
            # Sum over valid positions: zero the void ones in place, reduce the block's positions
            # in the logits' dtype (a plain reduction, never TF32 or the autocast dtype, unlike
            # a GEMV with the mask), and the blocks in float64.
            values.masked_fill_(void, 0.0)
            total += values.sum(dim=2).sum(dim=0, dtype=torch.float64)
    return sums


class _ClassPenalty(torch.autograd.Function):
    # Both passes run with autocast off: a backward called inside an autocast block (legal on
    # CPU, where backward runs on the calling thread) computes in float32 as well.
    @staticmethod
    def forward(ctx, logits, valid, margin, value_fn, grad_fn):  # type: ignore[override]
        if torch.compiler.is_compiling():
            return _compiled_forward(ctx, logits, valid, margin, value_fn, grad_fn)
        with autocast_off(logits.device):
            n, _, s = logits.shape
            maxima = torch.empty((n, 1, s), dtype=logits.dtype, device=logits.device)
            (per_class,) = class_sums(logits, valid, margin, [value_fn], maxima=maxima)
            denom = valid.sum().clamp(min=1) * logits.shape[1]
            ctx.save_for_backward(logits, maxima, valid)
            ctx.margin, ctx.grad_fn, ctx.denom = margin, grad_fn, denom
            return (per_class.sum() / denom).to(logits.dtype)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        if torch.compiler.is_compiling():
            grad = _compiled_backward(ctx, grad_out, *ctx.saved_tensors)
            return grad, None, None, None, None
        logits, maxima, valid = ctx.saved_tensors
        m = ctx.margin
        with autocast_off(logits.device):
            grad = torch.empty_like(logits)
            # -g_ik = -f'(z_ik) * valid_i * grad_out / (|V| K m); the arg-max class gets
            # sum_c g_ic.
            scale = -grad_out / (ctx.denom * m)
            for im, pos in blocks(logits):
                x, mx, g = logits[im, :, pos], maxima[im, :, pos], grad[im, :, pos]
                _constraint(x, mx, m, out=g)
                g = ctx.grad_fn(g)  # in place: g holds f'(z)
                g.mul_(valid[im, pos].unsqueeze(1).to(g.dtype) * scale)
                is_max = (x == mx).to(g.dtype)
                share = g.sum(dim=1, keepdim=True).div_(is_max.sum(dim=1, keepdim=True)).neg_()
                g.addcmul_(is_max, share)
                grad[im, :, pos] = g  # a no-op when grad_fn worked in place
        return grad, None, None, None, None


# Under torch.compile the two passes are written for the code generator, not for eager
# kernels: no blocks, no in-place buffers (inductor fuses each pass into loops over the
# positions with the K classes inside, so nothing block- or logits-sized is materialised but
# the gradient). The forward reduces over the classes of each position (the direction of that
# loop; per class over the positions is what observe() needs, not the training loss), and
# takes, in the same loop, the per-position ``sum_c f'(z_ic) / #ties``: backward is then
# pointwise and fuses into the cross-entropy's gradient loop. What the compiled graph keeps for
# backward is chosen by AOTAutograd's partitioner; tests/test_compile_sync.py checks that it is
# per-position maps beyond what the compiled cross-entropy keeps.
def _compiled_forward(ctx, logits, valid, margin, value_fn, grad_fn):
    maxima = logits.amax(dim=1, keepdim=True)
    # value_fn and grad_fn may work in place: each gets its own z
    per_position = value_fn(_constraint(logits, maxima, margin)).sum(dim=1)  # (N, S)
    total = per_position.masked_fill(~valid, 0.0).sum(dtype=torch.float64)
    ties = (logits == maxima).to(logits.dtype).sum(dim=1, keepdim=True)
    share = grad_fn(_constraint(logits, maxima, margin)).sum(dim=1, keepdim=True) / ties
    denom = valid.sum().clamp(min=1) * logits.shape[1]
    ctx.save_for_backward(logits, maxima, valid, share)
    ctx.margin, ctx.grad_fn, ctx.denom = margin, grad_fn, denom
    return (total / denom).to(logits.dtype)


def _compiled_backward(ctx, grad_out, logits, maxima, valid, share):
    # d/dl_ik = (grad_out / (|V| K m)) valid_i ([k is a max] sum_c f'(z_ic) / #ties - f'(z_ik))
    g = ctx.grad_fn(_constraint(logits, maxima, ctx.margin))
    scale = valid.unsqueeze(1).to(g.dtype) * (grad_out / (ctx.denom * ctx.margin))
    return (torch.where(logits == maxima, share, 0.0) - g) * scale


def class_penalty(
    logits: Tensor, valid: Tensor, margin: float | Tensor, value_fn: ElementFn, grad_fn: ElementFn
) -> Tensor:
    """Mean over valid positions and classes of ``f(z)``, with the analytic backward above.

    Args:
        logits: ``(N, K, S)`` floating point.
        valid: ``(N, S)`` bool, True where the target is not ``ignore_index``.
        margin: m > 0: a number, or a 0-dim tensor (what the ``margin: auto`` losses pass
            under ``torch.compile``, where a Python float would be a constant of the graph and
            each new margin a recompilation).
        value_fn: elementwise ``f(z)`` on a block ``z (n, K, s)``; may modify its argument in
            place. Its values at void positions are discarded.
        grad_fn: elementwise ``f'(z)``; should work in place (it is handed a block of the
            gradient buffer holding ``z``).

    Returns:
        0-dim tensor; 0 with a zero gradient when no position is valid.
    """
    margin = margin if torch.is_tensor(margin) else float(margin)
    return _ClassPenalty.apply(logits, valid, margin, value_fn, grad_fn)


# ---------------------------------------------------------------- CE and penalty in one pass
# The criterion ``CE + penalty`` of CALS-ALM / CALS-HR shares the reductions over the classes of
# each position: with ``t_ik = l_ik - max_j l_ij`` (<= 0, exactly 0 at the maxima),
#
#     CE_i    = log sum_k exp(t_ik) - t_iy
#     z_ik    = -t_ik / m - 1
#     d loss / d l_ik = (p_ik - [k == y_i]) / |V|  +  (-g_ik + [t_ik == 0] sum_c g_ic / T_i)
#
# on valid positions (0 elsewhere), with ``p = softmax(l)``, ``g_ik = f'(z_ik) / (|V| K m)`` (the
# derivative of ``f_k / (|V| K)`` in the distance ``d_ik = -t_ik``) and ``T_i`` the number of
# tied maxima (autograd of ``amax`` shares the gradient between them).
# Eager, one walk over the logits in blocks computes the value and writes the gradient (every
# temporary is block-sized; the gradient is the only logits-sized allocation), and backward
# scales it in place by the incoming gradient. Compiled, forward reduces over the classes of
# each position and keeps per-position maps, and backward is one pointwise loop (inductor fuses
# each into loops over the positions with the K classes inside).

GapTerms = Callable[[Tensor], tuple[Tensor, Tensor]]
"""A penalty as a function of the gaps: ``t (n, K, s) = l - max_j l_j`` (<= 0; may be
overwritten) -> ``(f'(z) / m, sum_k f(z_k))`` with ``z = -t / m - 1``: the derivative in the
distance ``d = -t`` ``(n, K, s)`` (it may live in ``t``'s storage) and the per-position value
``(n, 1, s)``."""


def constraint_of_gap(t: Tensor, margin: float | Tensor) -> Tensor:
    """``z = -t / m - 1`` in place in ``t`` (a 0-dim tensor margin is allowed)."""
    if torch.is_tensor(margin):
        return t.div_(margin).neg_().sub_(1.0)
    return t.mul_(-1.0 / margin).sub_(1.0)


def elementwise_gap_terms(value_fn: ElementFn, grad_fn: ElementFn,
                          margin: float | Tensor) -> GapTerms:
    """:data:`GapTerms` of an elementwise ``f`` and ``f'`` of ``z`` (as :func:`class_penalty`
    takes them; each may work in place)."""

    def terms(t: Tensor) -> tuple[Tensor, Tensor]:
        z = constraint_of_gap(t, margin)
        values = value_fn(z.clone()).sum(dim=1, keepdim=True)
        grad = grad_fn(z)
        return (grad.div_(margin) if torch.is_tensor(margin) else grad.mul_(1.0 / margin)), values

    return terms


def hinge_gap_terms(weight: Tensor, margin: float | Tensor) -> GapTerms:
    """:data:`GapTerms` of the hinge ``f_k(z) = w_k m relu(z) = w_k relu(d - m)`` (CALS-HR, per
    class ``weight (1, K, 1)``), in the gaps ``t = -d``: the value ``-sum_k w_k min(t_k + m, 0)``
    and ``f'_k(z) / m = w_k [t_k < -m]`` (written as a float in place: a comparison that
    writes a bool tensor is not vectorised on the CPU)."""

    def terms(t: Tensor) -> tuple[Tensor, Tensor]:
        shifted = t + margin  # d - m = -(t + m)
        if torch.compiler.is_compiling():
            # Two expressions (see phr_gap_terms); the derivative a where, since AOTAutograd
            # kept the logits-sized bool of a comparison cast to float for backward.
            value = (shifted.clamp(max=0.0) * weight).sum(dim=1, keepdim=True).neg()
            return torch.where(shifted < 0.0, weight, 0.0), value
        value = shifted.clamp_(max=0.0).mul_(weight).sum(dim=1, keepdim=True).neg_()
        return t.lt_(-margin).mul_(weight), value

    return terms


class _CEPenalty(torch.autograd.Function):
    # Both passes run with autocast off (see _ClassPenalty).
    @staticmethod
    def forward(ctx, logits, target, valid, terms):  # type: ignore[override]
        ctx.set_materialize_grads(False)
        with autocast_off(logits.device):
            if torch.compiler.is_compiling():
                ce, pen = _compiled_ce_penalty(ctx, logits, target, valid, terms)
            else:
                ce, pen = _blocked_ce_penalty(ctx, logits, target, valid, terms)
        loss = (ce + pen).to(logits.dtype)
        ce, pen = ce.to(logits.dtype), pen.to(logits.dtype)
        ctx.mark_non_differentiable(ce, pen)  # the terms, for logging
        return loss, ce, pen

    @staticmethod
    def backward(ctx, grad_out, _ce, _pen):  # type: ignore[override]
        if grad_out is None:
            return None, None, None, None
        if torch.compiler.is_compiling():
            return _compiled_ce_penalty_backward(ctx, grad_out), None, None, None
        # The gradient written by forward, scaled in place: no second logits-sized tensor (and
        # autograd hands it to the logits without a copy). So it serves one backward.
        if getattr(ctx, "spent", False):
            raise RuntimeError(
                "The CE + penalty criterion writes its gradient in forward and hands it to the "
                "logits at the first backward: a second backward through the same graph "
                "(retain_graph=True) needs the loss computed again."
            )
        ctx.spent = True
        (grad,) = ctx.saved_tensors
        with autocast_off(grad.device):
            return grad.mul_(grad_out), None, None, None


def _blocked_ce_penalty(ctx, logits: Tensor, target: Tensor, valid: Tensor,
                        terms: GapTerms) -> tuple[Tensor, Tensor]:
    k = logits.shape[1]
    inv = 1.0 / valid.sum().clamp(min=1).to(logits.dtype)  # 1 / |V|
    grad = torch.empty_like(logits)
    ce = torch.zeros((), dtype=torch.float64, device=logits.device)
    pen = torch.zeros((), dtype=torch.float64, device=logits.device)
    gaps = ties = None  # block buffers, reused
    for im, pos in blocks(logits):
        x, g = logits[im, :, pos], grad[im, :, pos]
        keep = valid[im, pos].unsqueeze(1)  # (n, 1, s)
        y = target[im, pos].clamp(0, k - 1).unsqueeze(1)  # void positions: any class
        if gaps is None or gaps.numel() < x.numel():
            gaps, ties = torch.empty(2, x.numel(), dtype=x.dtype, device=x.device)
        t = torch.sub(x, x.amax(dim=1, keepdim=True), out=gaps[: x.numel()].view(x.shape))
        at_max = torch.eq(t, 0.0, out=ties[: x.numel()].view(x.shape))  # 1.0 at the maxima
        t_y = t.gather(1, y)
        torch.exp(t, out=g)
        norm = g.sum(dim=1, keepdim=True)  # sum_k exp(t_k)
        ce += (norm.log() - t_y).masked_fill_(~keep, 0.0).sum(dtype=torch.float64)
        grad_f, values = terms(t)
        pen += values.masked_fill_(~keep, 0.0).sum(dtype=torch.float64)
        # softmax / |V| on valid positions, then the one-hot and the penalty's gradient
        scale = keep.to(x.dtype) * inv
        g.mul_(scale / norm)
        g.scatter_add_(1, y, -scale)
        share = grad_f.sum(dim=1, keepdim=True).div_(at_max.sum(dim=1, keepdim=True))
        grad_f.addcmul_(at_max, share.neg_())  # f' - [max] sum_c f' / T
        g.addcmul_(grad_f, scale.mul_(-1.0 / k))
    ctx.save_for_backward(grad)
    return ce * inv, pen * (inv / k)


def _classes(k: int, device: torch.device) -> Tensor:
    """``(1, K, 1)`` int32 class indices."""
    return torch.arange(k, dtype=torch.int32, device=device).view(1, k, 1)


def _compiled_ce_penalty(ctx, logits: Tensor, target: Tensor, valid: Tensor,
                         terms: GapTerms) -> tuple[Tensor, Tensor]:
    # The whole tensor at once (no blocks, no gradient): reductions over the classes of each
    # position, in one loop per position; backward recomputes the gradient from the logits and
    # per-position maps.
    k = logits.shape[1]
    inv = 1.0 / valid.sum().clamp(min=1).to(logits.dtype)
    maxima = logits.amax(dim=1, keepdim=True)
    t = logits - maxima
    log_norm = t.exp().sum(dim=1, keepdim=True).log()
    # t at the target as a masked sum over the classes: in the loop of the other reductions
    # (a gather is a loop of its own, after the target is cleaned, that reads the logits
    # again). Labels and classes compared in int32; a void label matches no class or gets
    # weight 0.
    target = target.to(torch.int32)
    t_y = torch.where(_classes(k, logits.device) == target.unsqueeze(1), t, 0.0).sum(
        dim=1, keepdim=True)
    ce = (log_norm - t_y).squeeze(1).masked_fill(~valid, 0.0).sum(dtype=torch.float64)
    grad_f, values = terms(logits - maxima)
    pen = values.squeeze(1).masked_fill(~valid, 0.0).sum(dtype=torch.float64)
    ties = (t == 0).to(t.dtype).sum(dim=1, keepdim=True)
    share = grad_f.sum(dim=1, keepdim=True) / ties
    # A forward output depends on share (times 0): so AOTAutograd computes it here, in the loop
    # that has the position's logits in cache, and saves it, instead of a second reduction
    # over the logits in backward.
    pen = pen + 0.0 * share.sum(dtype=torch.float64)
    ctx.save_for_backward(logits, target, valid, inv, maxima, log_norm, share)
    ctx.terms = terms
    return ce * inv, pen * (inv / k)


def _compiled_ce_penalty_backward(ctx, grad_out: Tensor) -> Tensor:
    logits, target, valid, inv, maxima, log_norm, share = ctx.saved_tensors
    k = logits.shape[1]
    t = logits - maxima
    grad_f, _ = ctx.terms(logits - maxima)
    one_hot = _classes(k, logits.device) == target.unsqueeze(1)
    scale = valid.unsqueeze(1).to(t.dtype) * (inv * grad_out)
    pen = grad_f - torch.where(t == 0, share, 0.0)
    return ((t - log_norm).exp() - one_hot.to(t.dtype)) * scale - pen * (scale * (1 / k))


def ce_penalty(logits: Tensor, target: Tensor, valid: Tensor,
               terms: GapTerms) -> tuple[Tensor, Tensor, Tensor]:
    """``CE + penalty`` of CALS-ALM / CALS-HR in one walk over the logits (formulas above).

    Args:
        logits: ``(N, K, S)`` floating point.
        target: ``(N, S)`` class indices; void positions (``valid`` False) may hold anything.
        valid: ``(N, S)`` bool.
        terms: the penalty as a function of the gaps (:data:`GapTerms`), e.g.
            :meth:`cals_seg.losses.penalties.Penalty.gap_terms` or :func:`hinge_gap_terms`.

    Returns:
        ``(loss, ce, penalty)``, 0-dim in the logits' dtype: ``loss = ce + penalty`` carries the
        gradient (``ce = (1/|V|) sum_{i in V} CE_i`` and ``penalty = (1/(|V| K)) sum_{i in V}
        sum_k f(z_ik)``, not differentiable, are for logging). 0 with a zero gradient when no
        position is valid.
    """
    return _CEPenalty.apply(logits, target, valid, terms)


def ce_sum(logits: Tensor, target: Tensor, ignore_index: int) -> Tensor:
    """Summed cross-entropy over valid positions (``logits (N, K, S)``, ``target (N, S)``)."""
    return torch.nn.functional.cross_entropy(
        logits, target, ignore_index=ignore_index, reduction="sum"
    )
