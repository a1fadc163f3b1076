"""Files written safely: atomic writes (a temporary file, fsync, rename), JSON and JSON-lines,
checkpoints that cannot carry code, and the random-number state of a run.

A checkpoint holds tensors, numbers, strings, lists, tuples and dicts only, and is read with
``torch.load(weights_only=True)``: loading a checkpoint someone shared cannot run code
(:func:`load_checkpoint`).
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cals_seg.errors import CheckpointError, RunFileError, UntrustedCheckpointError, UserError


def json_safe(obj: Any) -> Any:
    """``obj`` with NaN/inf floats replaced by None, so that the JSON is standard."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_safe(v) for v in obj]
    return obj


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # not supported on this platform
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | Path, write: Any) -> None:
    """Call ``write(tmp_path)``, fsync the file, then rename it to ``path`` (and fsync the
    folder): a crash or power cut leaves either the old file or the new one, never a part."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:  # a failed write (full disk, Ctrl-C) leaves no temporary file
        tmp.unlink(missing_ok=True)
        if isinstance(err, OSError) and not isinstance(err, UserError) or (
                type(err) is RuntimeError and ("inline_container" in str(err)
                                               or "write" in str(err).lower())):
            raise _write_error(err, path) from None
        raise
    _fsync_dir(path.parent)


def _write_error(err: Exception, path: Path) -> UserError:
    """A failed write as one line; torch.save reports a full disk as a RuntimeError of its
    C++ writer (``[enforce fail at inline_container.cc] ... unexpected pos``)."""
    from cals_seg.utils.paths import os_error

    if isinstance(err, OSError):
        return os_error(err, path, "write")
    free = shutil.disk_usage(path.parent).free if path.parent.exists() else 0
    return UserError(f"cannot write '{path}' ({str(err).splitlines()[0][:160]}); "
                     f"{free / 2**20:.0f} MiB free on its disk: free space and run again.")


def write_json(path: str | Path, obj: Any) -> None:
    """Atomic, standard JSON (NaN/inf written as null)."""
    text = json.dumps(json_safe(obj), indent=1)
    atomic_write(path, lambda tmp: Path(tmp).write_text(text))


def save_checkpoint(state: dict[str, Any], path: str | Path) -> None:
    """``torch.save`` atomically (see :func:`atomic_write`)."""
    atomic_write(path, lambda tmp: torch.save(state, tmp))


def link_checkpoint(src: str | Path, dst: str | Path) -> None:
    """Make ``dst`` an atomic copy of the checkpoint ``src`` without serialising it again: a
    hard link (``src`` is later *replaced*, never rewritten in place, so the link keeps this
    content), or a byte copy where the file system has no hard links."""
    src, dst = Path(src), Path(dst)
    tmp = dst.with_name(f".{dst.name}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        try:
            os.link(src, tmp)
        except OSError:
            shutil.copyfile(src, tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(tmp, dst)
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        if isinstance(err, OSError):
            raise _write_error(err, dst) from None
        raise
    _fsync_dir(dst.parent)


# What a checkpoint of an earlier version holds beyond plain types: NumPy's RNG state as a
# uint32 array. Rebuilding such an array runs no code of the file (its values are raw bytes), so
# these checkpoints are loaded safely with exactly these names allowed, and nothing else.
_MULTIARRAY = np._core.multiarray if hasattr(np, "_core") else np.core.multiarray
_LEGACY_NAMES = frozenset({"numpy.ndarray", "numpy.dtype", "numpy.core.multiarray._reconstruct",
                           "numpy._core.multiarray._reconstruct"})
_LEGACY_NUMPY = [
    np.ndarray, np.dtype, type(np.dtype(np.uint32)),  # uint32 only: no other dtype is built
    (_MULTIARRAY._reconstruct, "numpy.core.multiarray._reconstruct"),
    (_MULTIARRAY._reconstruct, "numpy._core.multiarray._reconstruct"),
]


def _refused_globals(path: Path) -> list[str]:
    """The Python objects (module.name) a file's pickle would build beyond the safe types."""
    try:
        return list(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    except Exception:  # not a zip checkpoint: the load itself reports it
        return []


def _read(path: Path, map_location: Any) -> Any:
    """``torch.load(weights_only=True)``, allowing an earlier version's NumPy RNG state.

    Raises:
        UntrustedCheckpointError: the pickle would build other objects (and run their code).
    """
    refused = _refused_globals(path)
    if not refused:
        return torch.load(path, map_location=map_location, weights_only=True)
    if set(refused) <= _LEGACY_NAMES:
        with torch.serialization.safe_globals(_LEGACY_NUMPY):
            return torch.load(path, map_location=map_location, weights_only=True)
    raise UntrustedCheckpointError(
        f"{path} holds Python objects that a checkpoint of this toolkit never holds "
        f"({', '.join(sorted(refused)[:3])}{', ...' if len(refused) > 3 else ''}); loading it "
        "could run code from the file, so it is refused. If you trust the file (you wrote it "
        f"yourself), convert it once: python tools/convert_checkpoint.py {path} --trust."
    )


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu",
                    fix: str | None = None) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint`, safely.

    Only tensors, numbers, strings, lists, tuples and dicts are read
    (``torch.load(weights_only=True)``): a checkpoint cannot run code when loaded, whoever
    wrote it. Checkpoints of earlier versions, whose NumPy RNG state is an array, load too (that
    array, and nothing else, is allowed) and come back in the current form (:func:`plain_rng`).

    Args:
        fix: the way out named at the end of a refusal (default: the run's other checkpoint, or
            retrain); :meth:`cals_seg.runs.run.Run.read_checkpoint` names the command's flag.

    Raises:
        CheckpointError: the file is missing, empty, truncated, not a checkpoint of this toolkit
            (another type, no ``model`` state dict of tensors): one line, never cut mid-word.
        UntrustedCheckpointError: its pickle would build other Python objects (convert a file
            you trust with ``tools/convert_checkpoint.py FILE --trust``).
    """
    path = Path(path)
    fix = fix or "use the run's other checkpoint, or retrain"
    if not path.is_file():
        raise CheckpointError(f"Checkpoint {path} does not exist.")
    try:
        size = path.stat().st_size
    except OSError:
        size = -1
    if size == 0:
        raise CheckpointError(path, "is empty (0 bytes: the write that made it did not finish)",
                              fix)
    try:
        state = _read(path, map_location)
    except UntrustedCheckpointError:
        raise
    except Exception as err:  # torch raises RuntimeError, EOFError, UnpicklingError ...
        raise CheckpointError(path, f"cannot be read ({checkpoint_problem(err)}); it is "
                              "truncated or not a checkpoint", fix) from None
    if not isinstance(state, dict):
        raise CheckpointError(path, f"holds a {type(state).__name__}, not a cals_seg checkpoint "
                              "(a dict with a 'model' state dict)", fix)
    if "model" not in state:
        raise CheckpointError(path, "is not a cals_seg checkpoint (no 'model' entry)", fix)
    model = state["model"]
    if not isinstance(model, Mapping) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in model.items()):
        raise CheckpointError(path, "is not a cals_seg checkpoint (its 'model' entry is not a "
                              "state dict of tensors)", fix)
    if isinstance(state.get("rng"), dict):
        state["rng"] = plain_rng(state["rng"])
    return state


def checkpoint_problem(err: BaseException, limit: int = 120) -> str:
    """What a failed ``torch.load`` says, in a few words: its first sentence, cut at a word
    (never mid-word) when longer than ``limit`` characters."""
    text = " ".join((str(err).strip().splitlines() or [""])[0].split())
    first = text.split(". ")[0].rstrip(".")
    return f"{type(err).__name__}: {short_text(first, limit)}" if first else type(err).__name__


def short_text(text: str, limit: int = 120) -> str:
    """``text`` on one line, cut at the last word boundary before ``limit`` characters (with
    ``...``) when longer."""
    text = " ".join(str(text).split())
    if len(text) <= limit:
        return text
    cut = text[:limit].rsplit(" ", 1)[0].rstrip(",;:")
    return f"{cut}..."


def rng_state() -> dict[str, Any]:
    """Python, NumPy, torch (and CUDA) RNG states, for an exact resume, in plain types (tuples
    of ints, dicts, tensors) that ``torch.load(weights_only=True)`` reads."""
    numpy_state = np.random.get_state(legacy=False)  # noqa: NPY002
    state = {
        "python": random.getstate(),
        "numpy": {
            "bit_generator": numpy_state["bit_generator"],
            "key": torch.from_numpy(numpy_state["state"]["key"].astype(np.int64)),
            "pos": int(numpy_state["state"]["pos"]),
            "has_gauss": int(numpy_state["has_gauss"]),
            "gauss": float(numpy_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def plain_rng(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with an earlier version's NumPy entry (the tuple of
    ``np.random.get_state()``, an array inside) in the form :func:`rng_state` writes."""
    numpy_state = state.get("numpy")
    if isinstance(numpy_state, tuple | list) and len(numpy_state) == 5:
        name, key, pos, has_gauss, gauss = numpy_state
        state = {**state, "numpy": {
            "bit_generator": str(name), "key": torch.as_tensor(np.asarray(key, np.int64)),
            "pos": int(pos), "has_gauss": int(has_gauss), "gauss": float(gauss)}}
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Inverse of :func:`rng_state`."""
    random.setstate(state["python"])
    n = plain_rng(state)["numpy"]
    np.random.set_state((n["bit_generator"], n["key"].cpu().numpy().astype(np.uint32),  # noqa: NPY002
                         n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


def _plain(obj: Any, where: str) -> Any:
    """``obj`` in the types ``torch.load(weights_only=True)`` reads (NumPy arrays and scalars
    become tensors and Python numbers); anything else is refused, naming its place."""
    if isinstance(obj, np.generic):  # before float: np.float64 is a float
        return obj.item()
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(obj))
    if isinstance(obj, torch.Tensor | str | bytes | bool | int | float | type(None)):
        return obj
    if isinstance(obj, dict):
        plain = type(obj)() if type(obj).__module__ == "collections" else {}
        plain.update((k, _plain(v, f"{where}[{k!r}]")) for k, v in obj.items())
        if getattr(obj, "_metadata", None) is not None:  # a state dict's module versions
            plain._metadata = _plain(obj._metadata, f"{where}._metadata")
        return plain
    if isinstance(obj, list | tuple):
        return type(obj)(_plain(v, f"{where}[{i}]") for i, v in enumerate(obj))
    raise CheckpointError(
        f"{where} is a {type(obj).__module__}.{type(obj).__qualname__}, which a checkpoint of "
        "this toolkit never holds; the file cannot be converted."
    )


def convert_checkpoint(path: str | Path, out: str | Path | None = None) -> Path:
    """Rewrite a checkpoint one trusts (an earlier version's, or one written by other code) in
    the plain types :func:`load_checkpoint` reads.

    The file is unpickled with ``weights_only=False``, which runs whatever code its pickle
    holds: call this only on a file you trust. ``out`` (default: ``path`` itself) is written
    atomically and read back safely.

    Raises:
        CheckpointError: unreadable, not a checkpoint, or holding objects that have no plain
            form.
    """
    path = Path(path)
    out = Path(out) if out is not None else path
    if not path.is_file():
        raise CheckpointError(f"Checkpoint {path} does not exist.")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)  # trusted by the caller
    except Exception as err:
        raise CheckpointError(f"Checkpoint {path} cannot be read ({checkpoint_problem(err)})."
                              ) from None
    if not isinstance(state, dict) or "model" not in state:
        raise CheckpointError(f"{path} is not a cals_seg checkpoint (no 'model' entry).")
    if isinstance(state.get("rng"), dict):
        state["rng"] = plain_rng(state["rng"])
    save_checkpoint(_plain(state, "checkpoint"), out)
    load_checkpoint(out)
    return out


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file (``[]`` when it does not exist). Strict: a line that
    is not JSON raises ``ValueError`` (:func:`read_jsonl_lines` keeps the good ones)."""
    path = Path(path)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_jsonl_lines(path: str | Path, keep: Callable[[Any], bool] | None = None
                     ) -> tuple[list[dict[str, Any]], list[tuple[int, str]]]:
    """The good records of a JSON-lines file and what is wrong with the others.

    A record is good when its line is JSON (no NaN / Infinity), an object, and passes
    ``keep`` (when given). The file's last line without its newline and not JSON is *torn*
    (the process stopped while writing it).

    Returns:
        ``(records, problems)``: problems as ``(line number from 1, what is wrong)``, e.g.
        ``(3, "torn (the process stopped while writing it)")``; ``([], [])`` for no file.

    Raises:
        RunFileError: the file cannot be read.
    """
    path = Path(path)
    if not path.is_file():
        return [], []
    raw = _read_bytes(path)
    lines = [line.decode("utf-8", "replace") if b"\0" not in line else "\0"
             for line in raw.split(b"\n")]
    records, problems = [], []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line, parse_constant=_refuse_constant)
        except ValueError:
            last = i == len(lines)  # no newline after it
            problems.append((i, "torn (the process stopped while writing it)" if last
                             else "not JSON"))
            continue
        if not isinstance(value, dict):
            problems.append((i, f"a {type(value).__name__}, not a JSON object"))
        elif keep is not None and not keep(value):
            problems.append((i, "missing a key or holding a value out of range"))
        else:
            records.append(value)
    return records, problems


# What is wrong with a value (None when right), for :func:`read_json_file`.
Check = Callable[[Any], str | None]


def read_json_file(path: str | Path, fix: str, what: str = "a JSON object",
                   checks: Mapping[str, Check] | None = None) -> dict[str, Any]:
    """The JSON object saved at ``path``, validated: one line naming the file, what is wrong
    and ``fix`` when it is missing, empty, truncated, not JSON (random bytes), not an object,
    holds NaN / Infinity (this toolkit writes ``null`` for them), lacks a key of ``checks`` or
    holds a value its check refuses.

    Args:
        fix: the way out, ending each message (``delete it and run ...``).
        what: what the file holds, with its article (``"a fitted temperature"``).
        checks: key -> a function returning what is wrong with the value (None: right).

    Raises:
        RunFileError: ``<path> <problem>; <fix>.``
    """
    path = Path(path)
    if not path.is_file():
        raise RunFileError(path, "does not exist", fix)
    raw = _read_bytes(path)
    if not raw.strip():
        raise RunFileError(path, "is empty (the write that made it did not finish)", fix)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise RunFileError(path, "is not JSON (it holds binary bytes)", fix) from None
    try:
        value = json.loads(text, parse_constant=_refuse_constant)
    except _NonFinite as err:
        raise RunFileError(path, f"holds {err.args[0]}, a number this toolkit never writes "
                           "(it writes null)", fix) from None
    except json.JSONDecodeError as err:  # a JSON object or list ends with its bracket
        truncated = err.pos >= len(text.rstrip()) or not text.rstrip().endswith(("}", "]"))
        problem = ("is truncated (not JSON: it ends mid-value)" if truncated else
                   f"is not valid JSON (line {err.lineno} column {err.colno}: {err.msg})")
        raise RunFileError(path, problem, fix) from None
    except (ValueError, RecursionError):
        raise RunFileError(path, "is not valid JSON", fix) from None
    if not isinstance(value, dict):
        raise RunFileError(path, f"holds a JSON {type(value).__name__}, not {what}", fix)
    for key, check in (checks or {}).items():
        if key not in value:
            raise RunFileError(path, f"has no {key!r} (not {what})", fix)
        wrong = check(value[key])
        if wrong:
            shown = short_text(json.dumps(value[key]), 40)
            raise RunFileError(path, f"{key}: expected {wrong}, got {shown}", fix)
    return value


def finite_number(minimum: float | None = None, above: bool = False) -> Check:
    """A check of :func:`read_json_file`: a finite number (not a bool), ``>= minimum`` (or
    ``> minimum`` with ``above``)."""
    bound = "" if minimum is None else f" {'>' if above else '>='} {minimum:g}"

    def check(value: Any) -> str | None:
        ok = (isinstance(value, int | float) and not isinstance(value, bool)
              and math.isfinite(value) and (minimum is None or value > minimum if above
                                            else minimum is None or value >= minimum))
        return None if ok else f"a finite number{bound}"

    return check


def of_type(kind: type | tuple[type, ...], name: str) -> Check:
    """A check of :func:`read_json_file`: an instance of ``kind`` (said as ``name``)."""
    return lambda value: None if isinstance(value, kind) and not isinstance(value, bool) \
        or kind is bool and isinstance(value, bool) else name


class _NonFinite(ValueError):
    pass


def _refuse_constant(name: str) -> Any:
    raise _NonFinite(name)


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as err:
        raise RunFileError(path, f"cannot be read ({err.strerror or type(err).__name__})",
                           "check its permissions") from None
