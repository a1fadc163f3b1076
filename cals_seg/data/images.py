"""The one image reader of the toolkit: every tool (training, evaluation, ``check_data``,
``predict_seg``) decodes a photo or a mask file here, so a file gives the same pixels, the same
size and the same error everywhere.

Rules (docs/reliability.md, "Image modes"):

* **Orientation.** The EXIF orientation tag is applied to images and to masks alike (a camera's
  portrait JPEG is upright in training, evaluation and prediction; a mask saved with the same tag
  turns with it, so image and mask keep the same size).
* **Photos** become RGB ``uint8 (H, W, 3)``:

  ======================  ==========================================================
  mode                    conversion
  ======================  ==========================================================
  ``RGB``                 as stored
  ``1``, ``L``, ``LA``    grey copied to the three channels (1-bit: 0 or 255)
  ``P``, ``PA``           the palette's colours
  ``RGBA``, ``RGBX``      the colour channels; the alpha channel is dropped
  ``CMYK``, ``YCbCr``,    PIL's conversion to RGB
  ``LAB``, ``HSV``
  ``I;16`` (16-bit)       ``round(v / 257)``: 0..65535 scaled to 0..255
  ``I`` (32-bit integer)  scaled as 16-bit when every value is in 0..65535, else refused
  ``F`` (float)           refused: a float image has no fixed range
  ======================  ==========================================================

* **Masks** keep their stored values (class indices, never colours): ``(H, W)`` for one
  channel (``L``, ``P`` indices, ``1``, ``I;16``, ``I``), ``(H, W, C)`` for colour masks, which
  the dataset decodes or refuses. A float mask is refused.

Every failure is a :class:`cals_seg.errors.DataError` of one line naming the file.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

from cals_seg.errors import DataError

#: Modes PIL converts to RGB exactly (or with a documented loss: alpha dropped).
RGB_MODES: frozenset[str] = frozenset(
    {"RGB", "1", "L", "LA", "La", "P", "PA", "RGBA", "RGBa", "RGBX", "CMYK", "YCbCr", "LAB", "HSV"}
)
#: 16-bit grey modes, scaled to 8 bits for photos.
MODES_16: frozenset[str] = frozenset({"I;16", "I;16L", "I;16B", "I;16N"})
#: The exceptions PIL raises for a file that is not a decodable image.
DECODE_ERRORS: tuple[type[BaseException], ...] = (
    OSError, SyntaxError, ValueError, Image.DecompressionBombError, EOFError
)


#: Every mode :func:`to_rgb` converts (a 32-bit ``I`` image only when its values fit 16 bits).
READABLE_MODES: frozenset[str] = RGB_MODES | MODES_16 | {"I"}


class ImageModeError(DataError):
    """An image whose pixel mode has no defined conversion (float, 32-bit beyond 16 bits)."""


def _open(path: Path, what: str) -> tuple[str, Image.Image]:
    """Decode ``path`` fully, upright (EXIF orientation applied); ``(stored mode, image)``."""
    try:
        with Image.open(path) as image:
            image.load()  # decode now: a truncated file fails here, not in a worker
            mode = image.mode
            upright = ImageOps.exif_transpose(image)
            upright.load()
            return mode, upright
    except DECODE_ERRORS as err:
        reason = os.strerror(err.errno) if isinstance(err, OSError) and err.errno else err
        raise DataError(
            f"Cannot read {what} '{path}' ({type(err).__name__}: {reason}): the file is "
            "missing, unreadable or truncated; restore it from the original archive or remove "
            "it from the data."
        ) from None


def scale_16(values: np.ndarray) -> np.ndarray:
    """16-bit values ``0..65535`` to 8 bits: ``round(v / 257)`` (65535 -> 255, 257 -> 1).

    Args:
        values: integer array of any shape, values in ``[0, 65535]``.

    Returns:
        ``uint8`` array of the same shape.
    """
    return np.rint(values.astype(np.float64) / 257.0).astype(np.uint8)


def to_rgb(image: Image.Image, path: Path | str, what: str = "image") -> np.ndarray:
    """An opened image as RGB ``uint8 (H, W, 3)`` by the rules of the module docstring.

    Raises:
        ImageModeError: a float image, or a 32-bit integer image with values beyond 16 bits.
    """
    mode = image.mode
    if mode in RGB_MODES:
        return np.array(image.convert("RGB"), dtype=np.uint8)
    if mode in MODES_16 or mode == "I":
        values = np.asarray(image).astype(np.int64)
        if values.size and (values.min() < 0 or values.max() > 65535):
            raise ImageModeError(
                f"{what} '{path}' is a 32-bit integer image (mode I) with values "
                f"{int(values.min())}..{int(values.max())} beyond 16 bits; save it as an 8-bit "
                "(or 16-bit) RGB or grey image."
            )
        grey = scale_16(values)
        return np.repeat(grey[..., None], 3, axis=2)
    raise ImageModeError(
        f"{what} '{path}' has mode {mode} ({'float' if mode == 'F' else 'no RGB conversion'}); "
        "its pixel range is not defined: save it as an 8-bit (or 16-bit) RGB or grey image."
    )


def read_rgb(path: str | os.PathLike, what: str = "image") -> np.ndarray:
    """An image file, upright, as RGB ``uint8 (H, W, 3)`` (module docstring: every mode).

    Raises:
        DataError: unreadable or truncated file; ImageModeError: a mode without conversion.
    """
    path = Path(path)
    _, image = _open(path, what)
    return to_rgb(image, path, what)


def read_stored(path: str | os.PathLike, what: str = "mask") -> tuple[str, np.ndarray]:
    """A mask file, upright, with its stored values: ``(mode, array)``, ``(H, W)`` for one
    channel (palette indices for ``P``, ``uint16`` for 16-bit) or ``(H, W, C)``.

    Raises:
        DataError: unreadable or truncated file, or a float (``F``) mask.
    """
    path = Path(path)
    mode, image = _open(path, what)
    if image.mode == "F":
        raise ImageModeError(f"{what} '{path}' is a float image (mode F); masks hold integer "
                             "class indices: save it as a grey or palette PNG.")
    if image.mode == "1":
        return mode, np.array(image, dtype=np.uint8)  # 0 / 1
    return mode, np.array(image)


def header_mode(path: str | os.PathLike, what: str = "image") -> str:
    """The stored mode of an image file, from its header (nothing is decoded).

    Raises:
        DataError: a file that is not an image.
    """
    try:
        with Image.open(path) as image:
            return image.mode
    except DECODE_ERRORS as err:
        raise DataError(f"Cannot read {what} '{path}' ({type(err).__name__}: {err}); restore it "
                        "or remove it from the data.") from None


def image_size(path: str | os.PathLike, what: str = "image") -> tuple[int, int]:
    """``(width, height)`` of a file once upright (EXIF orientation 5..8 swap the two), from its
    header; nothing is decoded.

    Raises:
        DataError: a file that is not an image.
    """
    path = Path(path)
    try:
        with Image.open(path) as image:
            width, height = image.size
            orientation = image.getexif().get(0x0112, 1)
    except DECODE_ERRORS as err:
        raise DataError(f"Cannot read {what} '{path}' ({type(err).__name__}: {err}); restore it "
                        "or remove it from the data.") from None
    return (height, width) if orientation in (5, 6, 7, 8) else (width, height)


__all__ = [
    "DECODE_ERRORS",
    "MODES_16",
    "RGB_MODES",
    "READABLE_MODES",
    "ImageModeError",
    "header_mode",
    "image_size",
    "read_rgb",
    "read_stored",
    "scale_16",
    "to_rgb",
]
