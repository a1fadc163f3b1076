"""Paths that come from data or name outputs, kept inside their roots, and the files a tool
writes, replaced only when the tool wrote them.

* :func:`check_id` / :func:`inside`: an id, stem or file name read from a split file, a folder
  listing or a config is relative, has no ``..`` part and no drive, and resolves (symbolic links
  followed) inside its root; anything else is refused naming the file and line.
* :func:`read_lines`: a split file decoded as UTF-8 (a byte-order mark dropped), every decoding
  or OS error one line naming the file.
* :class:`OutputFolder`: the folder a tool writes into. It refuses a folder that holds or
  overlaps the tool's inputs, and keeps a manifest (``.cals_seg_outputs.json``) of the files the
  tool wrote: an existing file is replaced only when it is in the manifest, so a user's file of
  the same name is never overwritten.
* :func:`os_error`: an ``OSError`` (full disk, permissions, a symbolic-link loop, a name too
  long) as one line naming the file and the fix.
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Iterable
from pathlib import Path, PurePosixPath, PureWindowsPath

from cals_seg.errors import DataError, UserError

MANIFEST = ".cals_seg_outputs.json"


class UnsafePathError(DataError):
    """An id or output name that would leave its root (absolute, ``..``, a drive, a NUL)."""


class OutputCollisionError(UserError, FileExistsError):
    """An output that would overwrite a file the tool did not write, or overlap its inputs."""


_FIXES = {
    errno.ENOSPC: "free disk space (or write elsewhere) and run again",
    errno.EDQUOT: "free space in your quota and run again",
    errno.EACCES: "check the permissions of the file and its folder",
    errno.EPERM: "check the permissions of the file and its folder",
    errno.EROFS: "the file system is read-only: write elsewhere",
    errno.ELOOP: "a symbolic link points (indirectly) to itself: remove or fix the link",
    errno.ENAMETOOLONG: "use a shorter name or path",
    errno.EISDIR: "a folder has the name of the file: rename or remove it",
    errno.ENOTDIR: "a part of the path is a file, not a folder",
    errno.EMFILE: "too many open files: raise the limit (ulimit -n) or use fewer workers",
}


def os_error(err: OSError, path: str | os.PathLike | None = None, doing: str = "access"
             ) -> UserError:
    """A :class:`UserError` of one line for an OS error: ``cannot <doing> '<path>': <reason>;
    <fix>.`` (raise it ``from None``)."""
    where = path if path is not None else (err.filename or "a file")
    reason = os.strerror(err.errno) if err.errno else str(err)
    fix = _FIXES.get(err.errno or -1, "check the path and run again")
    return UserError(f"cannot {doing} '{where}': {reason}; {fix}.")


def check_id(sample_id: str, where: str) -> str:
    """Refuse an id that is not a plain relative path: absolute (``/x``, ``C:\\x``, ``\\\\host``),
    with a ``..`` part, empty, or holding a NUL or control character.

    Args:
        sample_id: the id as read.
        where: the file and line it came from, e.g. ``"'train.txt' line 3"``.

    Returns:
        ``sample_id`` unchanged.

    Raises:
        UnsafePathError: naming ``where``, the id and the fix.
    """
    problem = None
    if not sample_id:
        problem = "is empty"
    elif any(ord(c) < 32 or c == "\x7f" for c in sample_id):
        problem = "holds a control character"
    elif (PurePosixPath(sample_id).is_absolute() or PureWindowsPath(sample_id).is_absolute()
          or PureWindowsPath(sample_id).drive or sample_id.startswith(("/", "\\", "~"))):
        problem = "is an absolute path"
    elif ".." in PurePosixPath(sample_id.replace("\\", "/")).parts:
        problem = "climbs out of its folder with '..'"
    if problem:
        raise UnsafePathError(
            f"{where}: the id {sample_id!r} {problem}; an id names a file inside the data root "
            "(e.g. 2007_000032): fix the line."
        )
    return sample_id


def inside(root: str | os.PathLike, relative: str | os.PathLike, where: str) -> Path:
    """``root / relative``, refused unless it resolves (links followed) inside ``root``.

    Raises:
        UnsafePathError: the path leaves ``root``, naming ``where``.
    """
    root = Path(root)
    path = root / relative
    try:
        real_root, real = root.resolve(), path.resolve()
    except (OSError, RuntimeError) as err:  # a symbolic-link loop
        raise UnsafePathError(f"{where}: '{path}' cannot be resolved ({err}); fix the "
                              "symbolic link.") from None
    if real != real_root and real_root not in real.parents:
        raise UnsafePathError(f"{where}: '{relative}' resolves to '{real}', outside "
                              f"'{root}'; fix the id or the link.")
    return path


def read_lines(path: str | os.PathLike, what: str = "split file") -> list[str]:
    """The lines of a text file decoded as UTF-8 (a leading byte-order mark dropped).

    Raises:
        DataError: a file that is not UTF-8 (naming the line and the byte), or any OS error
            (permissions, a symbolic-link loop, a folder), one line naming the file.
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise DataError(str(os_error(err, path, f"read the {what}"))) from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = raw[: err.start].count(b"\n") + 1
        raise DataError(
            f"{what} '{path}' line {line}: byte {raw[err.start]:#04x} is not UTF-8; save the "
            "file as UTF-8 (ids are plain ASCII names)."
        ) from None
    return text.splitlines()


def overlaps(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` are the same path or one holds the other (resolved)."""
    a, b = a.resolve(), b.resolve()
    return a == b or a in b.parents or b in a.parents


class OutputFolder:
    """The folder a tool writes into, with the manifest of the files it wrote there.

    Args:
        path: the output folder (created when missing).
        tool: the tool's name, for the messages.
        inputs: files and folders the tool reads; an output folder equal to, inside or holding
            one of them is refused (:meth:`check_inputs`).
    """

    def __init__(self, path: str | os.PathLike, tool: str,
                 inputs: Iterable[str | os.PathLike] = ()) -> None:
        self.path = Path(path)
        self.tool = tool
        self.check_inputs(inputs)
        self.manifest = self.path / MANIFEST
        self.written: set[str] = set()
        if self.manifest.is_file():
            try:
                self.written = set(json.loads(self.manifest.read_text(encoding="utf-8")))
            except (OSError, ValueError, TypeError):
                self.written = set()

    def check_inputs(self, inputs: Iterable[str | os.PathLike]) -> None:
        """Refuse an output folder that is an input, lies inside an input folder, or holds an
        input.

        Raises:
            OutputCollisionError: naming the input and the fix.
        """
        out = self.path.resolve()
        for item in inputs:
            item = Path(item)
            if not item.exists():
                continue
            real = item.resolve()
            if overlaps(out, real) if item.is_dir() else out in real.parents:
                raise OutputCollisionError(
                    f"{self.tool}: the output folder '{self.path}' overlaps the input "
                    f"'{item}'; the outputs could overwrite or be read as inputs: give --out a "
                    "folder outside the inputs."
                )

    def target(self, name: str) -> Path:
        """The path of output ``name`` (a relative name; sub-folders allowed), refused when it
        would leave the folder."""
        check_id(name, f"{self.tool} output")
        return inside(self.path, name, f"{self.tool} output") if self.path.exists() \
            else self.path / name

    def check_free(self, names: Iterable[str], replace_unlisted: bool = False) -> list[Path]:
        """The paths of ``names``, refused before any is written when one is a symbolic link,
        resolves outside the folder, or exists and is not the tool's own (not in the manifest;
        ``replace_unlisted``: a folder the toolkit made itself, e.g. inside a run, whose files
        of these names are its own outputs).

        Raises:
            OutputCollisionError: naming the file and the fix.
        """
        names = list(names)
        paths = [self.target(name) for name in names]
        for name, path in zip(names, paths, strict=True):
            if path.is_symlink():  # never written through, even when the tool made the name
                raise OutputCollisionError(
                    f"{self.tool}: '{path}' is a symbolic link; {self.tool} never writes through "
                    "a link: remove it, or give another output folder."
                )
            if path.exists() and name not in self.written and not replace_unlisted:
                raise OutputCollisionError(
                    f"{self.tool}: '{path}' exists and was not written by {self.tool}; it is "
                    "not overwritten: move it, or give another output folder."
                )
        return paths

    def claim(self, names: Iterable[str], only: bool = False) -> list[str]:
        """Record ``names`` as written by the tool (the manifest is rewritten atomically).

        Args:
            only: the folder holds one result, this one: the files an earlier run of the tool
                wrote (listed in the manifest) that ``names`` does not list are removed (plain
                files inside the folder only; never a link), and the manifest lists ``names``.

        Returns:
            the names of the files removed.
        """
        names = set(names)
        removed = []
        if only:
            for old in sorted(self.written - names):
                try:
                    path = self.target(old)
                except (UserError, ValueError, OSError):  # a name leaving the folder: not ours
                    continue
                if path.is_file() and not path.is_symlink():
                    path.unlink()
                    removed.append(old)
            self.written = set()
        self.written.update(names)
        self.path.mkdir(parents=True, exist_ok=True)
        tmp = self.manifest.with_name(self.manifest.name + ".tmp")
        try:
            tmp.write_text(json.dumps(sorted(self.written), indent=0), encoding="utf-8")
            os.replace(tmp, self.manifest)
        except OSError as err:
            tmp.unlink(missing_ok=True)
            raise os_error(err, self.manifest, "write") from None
        return removed


__all__ = [
    "MANIFEST",
    "OutputCollisionError",
    "OutputFolder",
    "UnsafePathError",
    "check_id",
    "inside",
    "os_error",
    "overlaps",
    "read_lines",
]
