"""The export's trace: ``torch.export`` with dynamic image sides, and the smallest side a
network's program holds.

A network's traced program is valid for a range of image sizes that only the trace knows: a
pooled branch whose feature map would be 1 x 1, a reflection padding wider than the map, a
size-dependent branch. :func:`trace_program` asks ``torch.export`` for automatic sides, reads
the range it recorded and its guards (the conditions besides the range), finds the smallest
side they allow, and traces again with sides declared from there when the guards do not visibly
hold above it (``torch.export`` refuses that declaration unless its program holds every such
size), so that ``sides >= min_size`` is true of the program written.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from torch import Tensor, nn

from cals_seg.errors import UserError

# How far the search for an image side the network runs at goes (the traced example): a
# network that fails at every side up to it is refused, naming its error.
_LARGEST_PROBE = 2048


def first_line(err: BaseException) -> str:
    """The first line of ``err``'s message, whitespace collapsed, at most 240 characters."""
    text = " ".join(str(err).strip().split("\n")[0].split())
    return (text[:240] or type(err).__name__).rstrip(".")


def root_cause(err: BaseException) -> BaseException:
    """The innermost cause of ``err`` (the exporters wrap what stops them, e.g. "No ONNX
    function found for aten.sort.stable", in errors whose own first line says nothing)."""
    seen = {id(err)}
    while err.__cause__ is not None and id(err.__cause__) not in seen:
        err = err.__cause__
        seen.add(id(err))
    return err


def _probe_side(module: nn.Module, start: int) -> int:
    """A side (from ``start``, doubling) at which ``module`` runs on a ``(2, 3, s, s + 2)``
    batch, the example the export traces.

    Raises:
        UserError: it fails at every side up to ``_LARGEST_PROBE``, naming the last error.
    """
    side, error = start, None
    while side <= _LARGEST_PROBE:
        try:
            with torch.no_grad():
                module(torch.zeros(2, 3, side, side + 2))
            return side
        except Exception as err:  # noqa: BLE001 (a network of the user's may raise anything)
            error, side = err, 2 * side + 1
    raise UserError(f"export: the network fails on every image size tried up to {_LARGEST_PROBE}"
                    f" pixels ({type(error).__name__}: {first_line(error)}).")


def _side_ranges(program: Any) -> list[tuple[int, float]]:
    """``[(lowest, highest), ...]`` of the height and width the exported ``program`` accepts
    (``highest`` is ``math.inf`` when unbounded, equal to ``lowest`` when specialised)."""
    name = program.graph_signature.user_inputs[0]
    node = next(n for n in program.graph.nodes if n.op == "placeholder" and n.name == name)
    out = []
    for size in node.meta["val"].shape[2:]:
        if isinstance(size, int):
            out.append((size, size))
            continue
        found = program.range_constraints[size.node.expr]
        upper = found.upper
        out.append((int(found.lower), float(upper) if getattr(upper, "is_finite", True)
                    and str(upper) != "int_oo" else math.inf))
    return out


class _SizeViolation(Exception):
    """torch.export found that the network's program does not hold every size asked for."""


def _export(module: nn.Module, example: tuple[Tensor], sides: list[Any],
            what: str = "this network") -> Any:
    """``torch.export.export`` of ``module`` with a dynamic batch (1 to 4096) and ``sides``.

    Raises:
        _SizeViolation: the sides asked for are not all held; UserError: any other failure.
    """
    dim = torch.export.Dim
    shapes = {"x": {0: dim("batch", min=1, max=4096), 2: sides[0], 3: sides[1]}}
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.export.export(module, example, dynamic_shapes=shapes)
    except Exception as err:  # noqa: BLE001 (torch.export raises many types, all one line here)
        if "onstraint" in str(err):
            raise _SizeViolation(first_line(err)) from None
        cause = root_cause(err)
        raise UserError(f"export: torch.export cannot trace {what} "
                        f"({type(cause).__name__}: {first_line(cause)}).") from None


def _accepts(ranges: list[tuple[int, float]], guards: Any, height: int, width: int) -> bool:
    """Whether a program holds an image of ``height x width``: inside its ``ranges``
    (:func:`_side_ranges`), and its ``guards`` (the conditions ``torch.export`` recorded besides
    the ranges) pass."""
    (h_low, h_high), (w_low, w_high) = ranges
    if not (h_low <= height <= h_high and w_low <= width <= w_high):
        return False
    if guards is None:
        return True
    try:
        guards(torch.empty(2, 3, height, width, device="meta"))
    except AssertionError:
        return False
    return True


def _smallest_side(program: Any) -> tuple[int, bool]:
    """The smallest side ``s`` at which ``program`` holds ``s x s``, and whether every size
    from it up to ``s + 64`` (and a few large ones) is held too."""
    guards = getattr(program.module(), "_guards_fn", None)
    ranges = _side_ranges(program)
    side = max(low for low, _ in ranges)
    while not _accepts(ranges, guards, side, side):
        side += 1
        if side > _LARGEST_PROBE:
            raise UserError(f"export: torch.export's program of this network holds no image "
                            f"size up to {_LARGEST_PROBE} pixels; resize images and export "
                            "with --min-size.")
    sizes = [*range(side, side + 65), 255, 256, 257, 1023, 1024, 1025, 4095, 4096]
    window = [(h, w) for h in sizes for w in sizes if h >= side and w >= side]
    return side, all(_accepts(ranges, guards, h, w) for h, w in window)


def trace_program(module: nn.Module, min_size: int | None = None,
                  what: str = "this network") -> tuple[Any, int]:
    """``module`` traced by ``torch.export`` with a dynamic batch size (1 to 4096), height and
    width, and the smallest side the program accepts.

    Without ``min_size``, the sides are first automatic (``torch.export`` records the range of
    sizes its program is valid for, and the guards besides); the smallest side ``s`` those
    allow is found, and when the guards do not visibly hold for every size above it the
    network is traced again with sides declared ``>= s``, which ``torch.export`` refuses unless
    its program holds every such size. With ``min_size``, the sides are declared
    ``>= min_size`` at once.

    Args:
        module: an export module (:class:`cals_seg.runs.export.CalibratedSegmenter` or
            :class:`~cals_seg.runs.export.ConformalSegmenter`; ``module.multiple`` is the
            network's side multiple).
        min_size: the smallest side asked for, or None (found).
        what: what is traced, for the messages.

    Raises:
        UserError: a ``min_size`` below what the network holds (naming the size to use), a
            network whose program holds no such range of sizes, or one ``torch.export``
            cannot trace (its first line).
    """
    dim = torch.export.Dim
    module = module.eval().to("cpu", torch.float32)
    base = max(2 * module.multiple, 16)
    side = _probe_side(module, (min_size or base) + 3)  # no multiple of the stride
    example = (torch.rand(2, 3, side, side + 2, generator=torch.Generator().manual_seed(0))
               * 255,)
    if min_size is not None:
        try:
            return _export(module, example, [dim("height", min=min_size),
                                             dim("width", min=min_size)], what), min_size
        except _SizeViolation as err:
            _, smallest = trace_program(module, what=what)
            if smallest > min_size:
                raise UserError(f"--min-size {min_size}: the network's exported program holds "
                                f"image sides >= {smallest} only; use --min-size {smallest} (or "
                                "leave it out: the smallest side is then found).") from None
            raise UserError(f"--min-size {min_size}: torch.export cannot hold every image side "
                            f">= {min_size} ({err}); leave --min-size out.") from None
    program = _export(module, example, [dim.AUTO(min=2), dim.AUTO(min=2)], what)
    smallest, holds = _smallest_side(program)
    if not holds:  # proven by torch.export itself, or refused
        try:
            program = _export(module, example, [dim("height", min=smallest),
                                                dim("width", min=smallest)], what)
        except _SizeViolation as err:
            raise UserError(f"export: torch.export's program of this network holds some image "
                            f"sizes only ({err}); resize images to one size and export with "
                            "--min-size.") from None
    return program, smallest


__all__ = ["first_line", "root_cause", "trace_program"]
