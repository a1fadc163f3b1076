"""One network call per distinct input image within an evaluation.

An evaluation streams the same images to several consumers that each ask for their logits: the
temperature fit, every calibrator fit (several passes for some), the conformal fit, the test
meters, the calibration maps, the entropy statistics of shift. Inside a :func:`logit_cache`
block, :func:`cached_logits` (called by
:func:`cals_seg.evaluation.inference.segment_logits`, the one place a segmentation network is
run for evaluation) keeps each image's logits and serves every later request for the same image
from memory, so the network sees each distinct input once.

The rule:

* **Key.** An image is identified by its content (a BLAKE2b digest of the normalised input
  tensor, its shape and dtype), with the network (the object), the evaluation protocol and the
  forward precision. A corrupted image is another input; the same image read twice, or by
  another loader, is the same input.
* **Batches.** A batch is served from memory when every image of it is held; otherwise the
  network runs on the whole batch (as it would without the cache) and each image's logits are
  kept. Loaders of the same split batch alike, so every consumer gets the bits it got before.
* **Budget.** Logits are kept until ``budget_bytes`` are held (``eval_seg --logit-cache-gb``,
  default 2 GiB); images beyond it are run again when asked for (counted as ``recomputed``).
  For the embedded dataset everything fits; a Cityscapes image's logits take 160 MB (K = 19,
  1024 x 2048, float32), so about a dozen fit in the default budget.

* **Passes.** A consumer that streams the same loader several times (a fit: the temperature's
  three passes, an L-BFGS iteration per pass of ``vector`` or ``dirichlet``) gets, after one
  complete pass held within the same budget, the batches of that pass again from memory
  (:meth:`LogitCache.replay`, called by :func:`cals_seg.evaluation.stream.predict`): the split
  is not read, decoded and hashed again for every pass. The batches are the same tensors a new
  pass would give (evaluation loaders are in order and their transforms deterministic; the
  corrupted copies of ``image_ts``'s fit are seeded per image), handed out as copies.

:attr:`LogitCache.stats` counts images forwarded, served from memory (by image or by replayed
pass) and recomputed; eval_seg writes it to ``metrics.json["network_passes"]``.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

DEFAULT_BUDGET_BYTES = 2 * 2**30

_ACTIVE: contextvars.ContextVar[LogitCache | None] = contextvars.ContextVar(
    "cals_seg_logit_cache", default=None)


def image_digest(image: Tensor) -> str:
    """BLAKE2b (16 bytes, hex) of one input ``(C, H, W)``: its bytes, shape and dtype."""
    data = image.detach()
    if data.device.type != "cpu":
        data = data.cpu()
    h = hashlib.blake2b(digest_size=16)
    h.update(repr((tuple(data.shape), str(data.dtype))).encode())
    h.update(data.contiguous().view(torch.uint8).numpy().tobytes()
             if data.dtype != torch.bfloat16 else data.float().numpy().tobytes())
    return h.hexdigest()


class LogitCache:
    """Logits of images already run, per network (see the module docstring).

    Args:
        budget_bytes: the most bytes of logits held; 0 holds none (every request runs).
    """

    def __init__(self, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> None:
        self.budget_bytes = int(budget_bytes)
        self.held_bytes = 0
        self._store: weakref.WeakKeyDictionary[nn.Module, dict[tuple, Tensor]] = \
            weakref.WeakKeyDictionary()
        self.stats = {"forwarded": 0, "served": 0, "recomputed": 0}
        self._seen: weakref.WeakKeyDictionary[nn.Module, set] = weakref.WeakKeyDictionary()
        self._passes: weakref.WeakKeyDictionary[Any, dict[tuple, list[tuple[Tensor, ...]]]] = \
            weakref.WeakKeyDictionary()

    def logits(self, model: nn.Module, images: Tensor, context: tuple,
               compute: Callable[[], Tensor]) -> Tensor:
        """The logits of ``images (N, C, H, W)``: from memory when all N are held, else
        ``compute()`` (the network on the whole batch), each image's logits then kept while
        the budget allows.

        Shape:
            ``images (N, C, H, W)`` -> ``(N, K, H, W)``, a new tensor (never the held one).
        """
        store = self._store.setdefault(model, {})
        seen = self._seen.setdefault(model, set())
        keys = [(context, image_digest(images[i])) for i in range(images.shape[0])]
        if keys and all(k in store for k in keys):
            self.stats["served"] += len(keys)
            return torch.stack([store[k] for k in keys])
        out = compute()
        for i, key in enumerate(keys):
            self.stats["recomputed" if key in seen else "forwarded"] += 1
            seen.add(key)
            if key in store:
                continue
            size = out[i].numel() * out[i].element_size()
            if self.held_bytes + size <= self.budget_bytes:
                store[key] = out[i].detach().clone()
                self.held_bytes += size
        return out


    def replay(self, loader: Any, context: tuple,
               source: Callable[[], Iterator[tuple[Tensor, ...]]]) -> Iterator[tuple[Tensor, ...]]:
        """The batches of one pass of ``loader`` (``source()``, e.g. ``(logits, target,
        inputs)``): the first pass is streamed and held (copies) while ``held_bytes`` stays
        within the budget; once one pass has been held to its end, every later pass with the
        same ``context`` (the network, device, precision, protocol) is served from memory, as
        copies (a consumer may work in place), each image counted as served. A pass stopped
        early or over the budget is not held (the next one streams again)."""
        held = self._passes.setdefault(loader, {})
        if context in held:
            for batch in held[context]:
                self.stats["served"] += int(batch[0].shape[0])
                yield tuple(t.clone() for t in batch)
            return
        kept: list[tuple[Tensor, ...]] | None = []
        size = 0
        for batch in source():
            if kept is not None:
                size += sum(t.numel() * t.element_size() for t in batch)
                if self.held_bytes + size <= self.budget_bytes:
                    kept.append(tuple(t.detach().clone() for t in batch))
                else:
                    kept = None
            yield batch
        if kept is not None:
            held[context] = kept
            self.held_bytes += size


@contextlib.contextmanager
def logit_cache(budget_bytes: int = DEFAULT_BUDGET_BYTES) -> Iterator[LogitCache]:
    """Within the block, :func:`cached_logits` serves repeated images from one
    :class:`LogitCache` (freed when the block ends)."""
    cache = LogitCache(budget_bytes)
    token = _ACTIVE.set(cache)
    try:
        yield cache
    finally:
        _ACTIVE.reset(token)


def active_cache() -> LogitCache | None:
    """The cache of the enclosing :func:`logit_cache` block, or None."""
    return _ACTIVE.get()


def cached_logits(model: nn.Module, images: Tensor, context: Any,
                  compute: Callable[[], Tensor]) -> Tensor:
    """``compute()``, or the logits held for these images by the active cache (none active:
    always ``compute()``). ``context``: what else the logits depend on (protocol, precision),
    hashable."""
    cache = _ACTIVE.get()
    if cache is None or torch.is_grad_enabled() or images.dim() < 2:
        return compute()
    return cache.logits(model, images, (context,), compute)


__all__ = ["DEFAULT_BUDGET_BYTES", "LogitCache", "active_cache", "cached_logits",
           "image_digest", "logit_cache"]
