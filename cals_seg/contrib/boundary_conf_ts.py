"""``boundary_ts_conf``: one temperature per cell of (predicted-boundary distance band) x
(confidence bin), the band set and the number of confidence bins chosen on held-out validation
images.

``boundary_ts`` gives every pixel of a distance band one temperature; what is left after it is
inside the bands: within a band the confident pixels and the hesitant ones are mis-calibrated in
different directions. Here a pixel ``p`` with band ``b(p)`` (the bands of
:func:`~cals_seg.calibrators.boundary_ts.predicted_bands`, from the *predicted* map) and network
confidence ``s(p) = max_k softmax(l(p))_k`` falls in the cell ``(b, q)`` where ``q`` is the bin
of ``u(p) = log s - log(1 - s)`` (the confidence's log-odds) among ``Q - 1`` edges of its band,
and::

    forward(l)(p) = l(p) / T_{b(p), q(p)}

A positive temperature per pixel keeps the argmax (so the bands and the cells, both computed
from the network's logits, are those of the fit).

Fit (validation only; the test split is never seen), for every candidate ``(bands, Q)``:

1. edges: the ``Q``-quantiles of ``u`` over the valid pixels of each band, from a histogram of
   ``u`` (``HIST_BINS`` bins of width ``HIST_STEP`` on ``[U_MIN, U_MAX]``; ``u`` outside it
   clipped), so every bin of a band holds about the same number of pixels;
2. the temperatures: the validation NLL is a sum of one-temperature NLLs, one per cell, so each
   ``T_{b,q}`` is the temperature-scaling optimum of its cell's pixels (grid refinement in
   ``log T``, ``passes`` passes, a parabola at the end, exactly as ``boundary_ts`` per band); a
   cell with fewer than ``min_count`` valid pixels, or whose optimum lies at the edge of the
   search range (``t_min`` / ``t_max``: all its pixels right, say, where ``T -> 0`` would make
   one test error cost ``gap / t_min`` nats), gets its band's temperature (the ``Q = 1`` fit
   of the same band set; a band at the edge gets the temperature of all pixels): the
   shrinkage of this method;
3. the choice: image ``j`` (loader order) is held out when ``j % holdout_every ==
   holdout_every - 1``; every candidate is fitted (1. and 2.) on the other images, scored by
   its mean NLL on the held-out ones, and the best (ties: the earlier, simpler one) is refitted
   on all validation images.

Default candidates: the band sets of ``boundary_ts_fine`` (``(3, 8)``, ``(1, 2, 3, 4, 6, 8,
12)``, ``(1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24)``) times ``Q`` in 1, 3, 6; the ``Q = 1`` ones
are ``boundary_ts_fine``'s candidates. All candidates are fitted in the same passes: 1
histogram pass, ``passes`` passes on the fit images, 1 scoring pass, ``passes`` passes on
all images (8 with the defaults, whatever the number of candidates). Memory: one batch plus
``O(cells x num_grid)`` sums.

Kept beside the core (``cals_seg.contrib``): on the embedded CE runs of both regimes (three
seeds, docs/calibrators.md) it did not beat ``boundary_ts_fine`` on the test split (validation
chose 3 bins, for held-out NLL gains of about 0.002). Importing this module registers
``boundary_ts_conf`` in ``CALIBRATORS``; opt in with ``import cals_seg.contrib.boundary_conf_ts``
or ``contrib: [boundary_conf_ts]`` in a config.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from cals_seg.calibrators._base import (
    Batches,
    Calibrator,
    holdout_split,
    iterate,
    score_candidates,
    valid_rows,
    with_holdout,
)
from cals_seg.calibrators._export import graph_bands
from cals_seg.calibrators._grid import grid_optima, refine_grids
from cals_seg.calibrators.boundary_ts import BoundaryTemperatureScaling, predicted_bands
from cals_seg.calibrators.registry import CALIBRATORS
from cals_seg.metrics.distance import int_thresholds
from cals_seg.utils.distributed import all_reduce_sum_
from cals_seg.utils.validation import check_int

BAND_SETS = ((3.0, 8.0), (1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0),
             (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 12.0, 16.0, 24.0))
CANDIDATES = tuple((b, q) for b in BAND_SETS for q in (1, 3, 6))
U_MIN, U_MAX, HIST_STEP = -10.0, 30.0, 0.01
HIST_BINS = round((U_MAX - U_MIN) / HIST_STEP)
# An edge that no pixel reaches (an unused bin, an empty band): finite, so that the state holds
# finite numbers only; ``u`` is finite for finite logits.
UNUSED = 1e300


def confidence_logodds(logits: Tensor) -> Tensor:
    """``u = log s - log(1 - s)`` of the top-label confidence ``s = max softmax(l)``, computed
    from the log-sum-exp of the other classes (exact for ``s`` near 1: ``u = l_top -
    logsumexp_{j != top} l_j``; ``+inf`` when the other classes have probability 0).

    Shape:
        - logits: ``(N, K, *S)``; returns ``(N, *S)`` in float32 (float64 for float64 logits).
    """
    x = logits.detach()
    x = x.double() if x.dtype == torch.float64 else x.float()
    top = x.amax(dim=1, keepdim=True)
    first = x.argmax(dim=1, keepdim=True)
    others = x.scatter(1, first, -math.inf)
    return (top - torch.logsumexp(others, dim=1, keepdim=True)).squeeze(1)


def conf_bins(u: Tensor, band: Tensor, edges: Tensor) -> Tensor:
    """Bin of every pixel: the number of its band's edges at or below ``u``.

    Shape:
        - u, band: ``(*S)``; edges: ``(B, Q - 1)`` (``UNUSED`` for unused edges); returns ``(*S)``
          int64 in ``[0, Q - 1]``.
    """
    if edges.shape[1] == 0:
        return torch.zeros_like(band)
    e = edges.to(u.device, u.dtype)[band]
    return (u.unsqueeze(-1) >= e).sum(dim=-1)


def cell_grid_nll(rows: Tensor, labels: Tensor, cell: Tensor, log_t: Tensor) -> Tensor:
    """Summed NLL of every cell at each temperature of its own grid, in float64:
    ``out[c, g] = sum_{i: cell_i = c} logsumexp_k(l_ik / T_cg) - l_{i,y_i} / T_cg`` with
    ``T_cg = exp(log_t[c, g])`` (rows shifted by their max first; the NLL is shift-invariant),
    over chunks of positions so that the ``(chunk, G, K)`` work tensor stays at 2^22 elements.

    Shape:
        - rows: ``(P, K)``; labels: ``(P,)``; cell: ``(P,)`` int64 (CPU); log_t: ``(C, G)``
          float64; returns ``(C, G)`` float64 on the CPU.
    """
    c, g = log_t.shape
    k = rows.shape[1]
    out = torch.zeros(c, g, dtype=torch.float64, device=rows.device)
    inv_t = (-log_t).exp().to(rows.device)
    cell = cell.to(rows.device)
    step = max(1, 2**22 // (g * k))
    for start in range(0, rows.shape[0], step):
        chunk = rows[start:start + step].to(torch.float64)
        chunk = chunk - chunk.amax(dim=1, keepdim=True)
        true = chunk.gather(1, labels[start:start + step, None].to(rows.device))  # (p, 1)
        scale = inv_t[cell[start:start + step]]  # (p, G)
        lse = (chunk[:, None, :] * scale[:, :, None]).exp_().sum(dim=2).log_()
        onehot = torch.nn.functional.one_hot(cell[start:start + step], c).to(torch.float64)
        out += onehot.T @ (lse - scale * true)  # (faster than index_add_ on the CPU)
    return out.cpu()


def _quantile_edges(hist: Tensor, q: int) -> Tensor:
    """``(B, Q - 1)`` edges in ``u`` splitting each band's histogram ``(B, HIST_BINS)`` into
    ``q`` parts of about equal count (an edge is the upper end of the histogram bin where the
    cumulative count first reaches ``i / q`` of the band's total); ``UNUSED`` for an empty
    band."""
    out = torch.full((hist.shape[0], q - 1), UNUSED, dtype=torch.float64)
    cum = hist.cumsum(dim=1).double()
    for b in range(hist.shape[0]):
        total = float(cum[b, -1])
        if total == 0:
            continue
        for i in range(1, q):
            k = int(torch.searchsorted(cum[b], total * i / q))
            out[b, i - 1] = U_MIN + HIST_STEP * (k + 1)
    return out


class BandConfidenceTemperatures(nn.Module):
    """``l(p) / T[band(p), bin(p)]`` (``boundary_ts_conf`` for export): the bands of
    :func:`~cals_seg.calibrators._export.graph_bands`, the bin of the confidence's log-odds
    among its band's edges.

    Args:
        bands: the band distances in pixels.
        edges: ``(B, Q - 1)`` log-odds edges of each band.
        temperatures: ``(B, Q)``.

    Shape:
        - logits: ``(N, K, H, W)`` -> same shape.
    """

    def __init__(self, bands: Sequence[float], edges: Tensor, temperatures: Tensor) -> None:
        super().__init__()
        self.thresholds = int_thresholds(bands)
        self.num_bins = int(temperatures.shape[1])
        self.register_buffer("edges", edges.detach().to("cpu", torch.float32).clone())
        self.register_buffer("temperatures",
                             temperatures.detach().to("cpu", torch.float32).reshape(-1).clone())

    def forward(self, logits: Tensor, image: Tensor | None = None) -> Tensor:
        band = graph_bands(logits, self.thresholds)
        cell = band * self.num_bins
        if self.num_bins > 1:
            u = confidence_logodds(logits)
            cell = cell + (u.unsqueeze(-1) >= self.edges.to(u.dtype)[band]).sum(dim=-1)
        return logits / self.temperatures.to(logits.dtype)[cell].unsqueeze(1)


@CALIBRATORS.register("boundary_ts_conf")
class BoundaryConfidenceTemperatureScaling(Calibrator):
    """One temperature per (predicted-boundary band, confidence bin) cell; the band set and the
    number of bins chosen on held-out validation images (module docstring).

    Buffers: ``temperatures`` ``(B_max, Q_max)`` (the chosen candidate's in the top-left
    corner, 1.0 elsewhere), ``edges`` ``(B_max, Q_max - 1)`` in log-odds (``UNUSED`` where
    unused) and ``choice`` (index of the chosen candidate, int64).

    Args:
        num_classes: K >= 2.
        candidates: ``(bands, Q)`` pairs: increasing positive finite band distances in pixels
            and a number of confidence bins >= 1.
        min_count: cells with fewer valid validation pixels get their band's temperature.
        holdout_every: one validation image in ``holdout_every`` scores the candidates (>= 2).
        t_min, t_max, num_grid, passes: as :class:`BoundaryTemperatureScaling`.

    Shape:
        - logits: ``(N, K, H, W)`` -> same shape.
    """

    name = "boundary_ts_conf"
    changes_argmax = False

    temperatures: Tensor
    edges: Tensor
    choice: Tensor

    def __init__(self, num_classes: int,
                 candidates: Sequence[Sequence[Any]] = CANDIDATES,
                 min_count: int = 200, holdout_every: int = 5, t_min: float = 0.05,
                 t_max: float = 20.0, num_grid: int = 33, passes: int = 3) -> None:
        cands = []
        for c in candidates:
            if not (isinstance(c, list | tuple) and len(c) == 2):
                raise ValueError(f"Expected each of `candidates` to be (bands, Q), but got {c!r}.")
            check_int("candidates Q", c[1])
            BoundaryTemperatureScaling(num_classes, c[0], t_min, t_max, num_grid, passes)
            cands.append([[float(b) for b in c[0]], int(c[1])])
        if not cands:
            raise ValueError("Expected at least one (bands, Q) pair in `candidates`.")
        check_int("min_count", min_count)
        check_int("holdout_every", holdout_every, 2)
        super().__init__(num_classes, candidates=cands, min_count=min_count,
                         holdout_every=holdout_every, t_min=float(t_min), t_max=float(t_max),
                         num_grid=num_grid, passes=passes)
        nb = max(len(b) for b, _ in cands) + 1
        nq = max(q for _, q in cands)
        self.register_buffer("temperatures", torch.ones(nb, nq))
        self.register_buffer("edges", torch.full((nb, nq - 1), UNUSED, dtype=torch.float64))
        self.register_buffer("choice", torch.zeros((), dtype=torch.int64))

    @property
    def bands(self) -> list[float]:
        """The chosen band set."""
        return self.params["candidates"][int(self.choice)][0]

    @property
    def num_bins(self) -> int:
        """The chosen number of confidence bins."""
        return self.params["candidates"][int(self.choice)][1]

    # ------------------------------------------------------------------ fitting machinery
    def _histograms(self, batches: Batches, band_sets: list[list[float]]) -> list[list[Tensor]]:
        """One pass: for each band set, the ``u`` histograms ``(B, HIST_BINS)`` of the fit images
        and of all images (valid pixels)."""
        every = self.params["holdout_every"]
        out = [[torch.zeros(len(b) + 1, HIST_BINS, dtype=torch.int64) for _ in range(2)]
               for b in band_sets]
        for logits, target, _, held in with_holdout(batches, every):
            valid = target.to(logits.device) != self._ignore
            u = confidence_logodds(logits)
            idx = ((u.double().clamp(U_MIN, U_MAX - HIST_STEP / 2) - U_MIN) / HIST_STEP).long()
            idx = idx.clamp(0, HIST_BINS - 1)
            for s, bands in enumerate(band_sets):
                band = predicted_bands(logits, bands)
                flat = band * HIST_BINS + idx
                for j, mask in enumerate((valid & ~held[:, None, None], valid)):
                    out[s][j] += torch.bincount(flat[mask], minlength=(len(bands) + 1) *
                                                HIST_BINS).view(len(bands) + 1, -1).cpu()
        all_reduce_sum_([h for pair in out for h in pair])
        return out

    def _cells(self, logits: Tensor, specs: list[tuple[list[float], Tensor]]) -> list[Tensor]:
        """The cell index ``band * Q + bin`` of every pixel ``(N*H*W,)`` for every spec."""
        u = confidence_logodds(logits)
        bands_cache: dict[tuple[float, ...], Tensor] = {}
        out = []
        for bands, edges in specs:
            key = tuple(bands)
            if key not in bands_cache:
                bands_cache[key] = (predicted_bands(logits, bands) if bands else
                                    torch.zeros(u.shape, dtype=torch.int64, device=u.device))
            band = bands_cache[key]
            out.append((band * max(edges.shape[1] + 1, 1) + conf_bins(u, band, edges)).reshape(-1))
        return out

    def _fit_cells(self, batches: Batches, specs: list[tuple[list[float], Tensor]],
                   ) -> tuple[list[Tensor], list[Tensor]]:
        """Per spec, the NLL-optimal temperature of every cell ``(B * Q,)`` and its count, by
        ``passes`` passes of grid refinement over all cells of all specs at once. A cell whose
        optimum is at the edge of the search range (``t_min`` or ``t_max``: e.g. all its
        pixels right, ``T -> 0``) is returned with count 0, so that it takes its parent's
        temperature."""
        p = self.params
        g = p["num_grid"]
        sizes = [(len(b) + 1) * (e.shape[1] + 1) for b, e in specs]
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        n = sum(sizes)

        def sweep(log_t: Tensor) -> tuple[Tensor, Tensor]:
            total = torch.zeros(n, g, dtype=torch.float64)
            count = torch.zeros(n, dtype=torch.int64)
            for logits, target, _ in iterate(batches):
                if logits.dim() != 4:
                    raise ValueError(f"Expected `logits` of shape (N, K, H, W), but got "
                                     f"{tuple(logits.shape)}.")
                rows, labels = valid_rows(logits, target, self._ignore)
                valid = target.reshape(-1).to(logits.device) != self._ignore
                for off, cell in zip(offsets, self._cells(logits, specs), strict=True):
                    cell = cell[valid].cpu() + off
                    total += cell_grid_nll(rows, labels, cell, log_t)
                    count += torch.bincount(cell, minlength=n)
            all_reduce_sum_([total, count])
            return total, count

        log_t, total, best, count = refine_grids(sweep, n, p["t_min"], p["t_max"], g,
                                                 p["passes"], self._ignore)
        temps = torch.ones(n, dtype=torch.float64)
        edge = torch.zeros(n, dtype=torch.bool)  # optimum at the edge of the search range
        for c, x in enumerate(grid_optima(log_t, total, best)):
            edge[c] = (x <= math.log(p["t_min"]) + 1e-9) or (x >= math.log(p["t_max"]) - 1e-9)
            temps[c] = math.exp(x)
        return ([temps[o:o + s] for o, s in zip(offsets, sizes, strict=True)],
                [torch.where(edge[o:o + s], 0, count[o:o + s])
                 for o, s in zip(offsets, sizes, strict=True)])

    def _candidate_temps(self, batches: Batches, cands: list[list[Any]],
                         edges: list[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
        """Per candidate, ``(B, Q)`` temperatures (cells under ``min_count`` take their band's
        temperature; a band without pixels takes that of all pixels) and counts."""
        band_sets = sorted({tuple(b) for b, _ in cands})
        specs = [(list(b), torch.zeros(len(b) + 1, 0, dtype=torch.float64)) for b in band_sets]
        specs.append(([], torch.zeros(1, 0, dtype=torch.float64)))  # all pixels: one cell
        where = []  # the spec of every candidate (Q = 1: its band set's)
        for (bands, q), e in zip(cands, edges, strict=True):
            if q == 1:
                where.append(band_sets.index(tuple(bands)))
            else:
                where.append(len(specs))
                specs.append((list(bands), e))
        temps, counts = self._fit_cells(batches, specs)
        pooled = float(temps[len(band_sets)][0])
        band_t = {}
        for bands, t, c in zip(band_sets, temps, counts, strict=False):
            t = t.clone()
            t[c == 0] = pooled  # a band without validation pixels: the temperature of all
            band_t[bands] = t
        out_t, out_c = [], []
        for (bands, q), i in zip(cands, where, strict=True):
            t = temps[i].view(len(bands) + 1, q).clone()
            c = counts[i].view(len(bands) + 1, q)
            parent = band_t[tuple(bands)][:, None].expand_as(t)
            small = c < self.params["min_count"]
            t[small] = parent[small]
            out_t.append(t)
            out_c.append(c)
        return out_t, out_c

    # ------------------------------------------------------------------------------ fit
    def fit(self, batches: Batches, ignore_index: int = -100) -> dict[str, Any]:
        """Choose ``(bands, Q)`` on held-out validation images, then refit it on all of them."""
        p = self.params
        self._ignore = ignore_index
        every = p["holdout_every"]
        cands = p["candidates"]
        band_sets = [list(b) for b in sorted({tuple(b) for b, _ in cands})]
        hists = self._histograms(batches, band_sets)
        hist_of = {tuple(b): h for b, h in zip(band_sets, hists, strict=True)}
        edges_fit = [_quantile_edges(hist_of[tuple(b)][0], q) for b, q in cands]
        temps, _ = self._candidate_temps(holdout_split(batches, every, "fit"), cands, edges_fit)
        heldout, best = score_candidates(batches, every, ignore_index, [
            functools.partial(self._calibrate, bands=bands, edges=edges_fit[i], temps=temps[i])
            for i, (bands, _q) in enumerate(cands)])
        bands, q = cands[best]
        edges = _quantile_edges(hist_of[tuple(bands)][1], q)
        final_t, final_c = self._candidate_temps(batches, [cands[best]], [edges])
        self.choice.fill_(best)
        self.temperatures.fill_(1.0)
        self.temperatures[: len(bands) + 1, :q] = final_t[0].to(self.temperatures)
        self.edges.fill_(UNUSED)
        self.edges[: len(bands) + 1, : q - 1] = edges.to(self.edges)
        if bool((final_t[0] <= p["t_min"] * 1.0001).any() or
                (final_t[0] >= p["t_max"] * 0.9999).any()):
            warnings.warn("boundary_ts_conf: the NLL of all validation pixels is minimal at "
                          "the search boundary.", stacklevel=2)
        self.fit_info = {
            "bands": bands, "conf_bins": q, "heldout_nll": heldout,
            "candidates": cands, "temperatures": final_t[0].tolist(),
            "edges_logodds": edges.tolist(), "count_cell": final_c[0].tolist(),
            "heldout": f"every {every}th validation image in loader order",
            "passes": 2 * p["passes"] + 2,
        }
        return self.fit_info

    # -------------------------------------------------------------------------- forward
    def _calibrate(self, logits: Tensor, bands: Sequence[float], edges: Tensor,
               temps: Tensor) -> Tensor:
        band = predicted_bands(logits, bands)
        q = conf_bins(confidence_logodds(logits), band, edges)
        t = temps.to(logits.device, logits.dtype)[band, q]
        return logits / t.unsqueeze(1)

    def forward(self, logits: Tensor, image: Tensor | None = None) -> Tensor:
        self.check_input(logits, image)
        if logits.dim() != 4:
            raise ValueError(
                f"Expected `logits` of shape (N, K, H, W), but got {tuple(logits.shape)}."
            )
        bands, q = self.bands, self.num_bins
        nb = len(bands) + 1
        return self._calibrate(logits, bands, self.edges[:nb, : q - 1],
                           self.temperatures[:nb, :q])

    def export_module(self, fmt: str = "pt2") -> torch.nn.Module:
        """The chosen cells as a program for export (:class:`BandConfidenceTemperatures`)."""
        bands, q = self.bands, self.num_bins
        nb = len(bands) + 1
        return BandConfidenceTemperatures(bands, self.edges[:nb, : q - 1],
                                          self.temperatures[:nb, :q])
