"""A training run's ``--out`` directory, written so that a kill at any moment leaves every checkpoint whole.

A checkpoint ``step-N`` is filled as ``step-N.tmp-<pid>``, its files and the directory fsynced,
then renamed into place; only then is ``latest`` (the name of the newest checkpoint) replaced the
same way (a temporary file, fsync, rename, then the directory fsynced). So ``latest`` always names
a complete checkpoint, a kill loses at most the save under way (a ``*.tmp-<pid>`` entry, removed
when the run is resumed), and the checkpoint ``latest`` names is never written again.
"""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Callable

LATEST = "latest"
_CHECKPOINT = re.compile(r"step-\d+")
_STAGING = re.compile(r".+\.tmp-\d+")


class RunDirectoryError(ValueError):
    """``--out`` cannot be used as asked; the message names the option and what to do instead."""


def _fsync(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _set_latest(out: Path, name: str) -> None:
    staging = out / f"{LATEST}.tmp-{os.getpid()}"
    with open(staging, "w") as handle:
        handle.write(name)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(staging, out / LATEST)
    _fsync(out)


def save(out: Path, name: str, write: Callable[[Path], None]) -> Path:
    """``write(directory)`` fills a temporary sibling of ``out/name``, which then durably becomes
    ``out/name``, and ``latest`` names it. The caller never saves again under the name ``latest``
    gives (a name is one training state). An existing ``out/name`` is the leftover of a save whose
    ``latest`` update was lost, which nothing names: it is replaced."""
    target = out / name
    staging = out / f"{name}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    write(staging)
    for path in staging.rglob("*"):
        if path.is_file():
            _fsync(path)
    _fsync(staging)
    if target.exists():
        shutil.rmtree(target)
    os.replace(staging, target)
    _fsync(out)
    _set_latest(out, name)
    return target


def _remove(out: Path, pattern: re.Pattern) -> None:
    for entry in out.iterdir():
        if pattern.fullmatch(entry.name):
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()


def prepare(out: Path, *, resume: bool, overwrite: bool, writer: bool) -> Path | None:
    """Make ``out`` ready for a run: the checkpoint to resume from (``resume``), or None for a new
    run, which needs an empty ``out`` unless ``overwrite`` (then the earlier run's ``latest`` and
    ``step-*`` go, ``latest`` first). Only the ``writer`` (rank 0) removes anything."""
    out.mkdir(parents=True, exist_ok=True)
    if overwrite:
        if writer:
            (out / LATEST).unlink(missing_ok=True)
            _remove(out, re.compile(rf"({_CHECKPOINT.pattern}|{LATEST})(\.tmp-\d+)?"))
        return None
    if not resume:
        entries = sorted(entry.name for entry in out.iterdir())
        if entries:
            shown = ", ".join(entries[:4]) + (", ..." if len(entries) > 4 else "")
            raise RunDirectoryError(f"--out {out}: not empty ({shown}); continue its run with --resume, or give "
                                    f"--overwrite to replace its checkpoints")
        return None
    if not (out / LATEST).exists():
        raise RunDirectoryError(f"--resume: no checkpoint in {out} (no '{LATEST}' file)")
    name = (out / LATEST).read_text().strip()
    if not _CHECKPOINT.fullmatch(name) or not (out / name).is_dir():
        raise RunDirectoryError(f"--resume: {out / LATEST} names {name!r}, which is not a checkpoint directory "
                                f"(step-N) in {out}")
    if writer:
        _remove(out, _STAGING)  # saves a kill cut short
    return out / name
