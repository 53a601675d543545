"""A training run's ``--out`` directory, written so that a kill at any moment leaves every checkpoint whole.

A checkpoint ``step-N`` is filled as ``step-N.tmp-<pid>``, its files and the directory fsynced,
then renamed into place; only then is ``latest`` (the name of the newest checkpoint) replaced the
same way (a temporary file, fsync, rename, then the directory fsynced). So ``latest`` always names
a complete checkpoint, a kill loses at most the save under way (a ``*.tmp-<pid>`` entry, removed
when the run is resumed), and the checkpoint ``latest`` names is never written again.

Each checkpoint carries ``SHA256SUMS`` (``sha256sum -c`` reads it), written before the rename: a
resume verifies every file against it and refuses a checkpoint whose files changed, went missing
or were added after the save (a disk error, a partial copy, an edit), before anything is loaded.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Callable

from ..weights import CheckpointError

LATEST = "latest"
MANIFEST = "SHA256SUMS"
_MANIFEST_LINE = re.compile(r"([0-9a-f]{64})  (.+)")
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


def sha256_file(path: Path | str) -> str:
    """The hex sha256 of a file, read in 1 MiB chunks (``hashlib.file_digest`` needs Python 3.11)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _files(directory: Path) -> list[str]:
    """The regular files under ``directory`` but its manifest, as POSIX paths relative to it."""
    return sorted(path.relative_to(directory).as_posix() for path in directory.rglob("*")
                  if path.is_file() and path.name != MANIFEST)


def _write_manifest(directory: Path) -> None:
    """SHA256SUMS in sha256sum's format, so a checkpoint can be checked by hand too."""
    lines = (f"{sha256_file(directory / name)}  {name}\n" for name in _files(directory))
    (directory / MANIFEST).write_text("".join(lines))


def verify(checkpoint: Path) -> None:
    """Raise ``CheckpointError`` naming the first file of ``checkpoint`` that is not as it was
    saved: its sha256 differs from SHA256SUMS, it is missing, or SHA256SUMS does not list it. A
    checkpoint saved before SHA256SUMS existed is resumed with a FutureWarning, for one release."""
    manifest = checkpoint / MANIFEST
    if not os.path.lexists(manifest):  # saved before checkpoints carried one: accepted for one more release
        warnings.warn(f"{checkpoint}: no {MANIFEST} (saved by ms_rope_attention 0.1.0 or earlier), so its files are "
                      "not verified; resuming from it unverified. From the next release such a checkpoint is "
                      "refused: resume once and save, which writes one.", FutureWarning, stacklevel=2)
        return
    if not manifest.is_file():  # is_file: a FIFO would block the read
        raise CheckpointError(f"{manifest}: missing or not a regular file; without it the checkpoint cannot be "
                              f"verified")
    try:
        text = manifest.read_text(errors="replace")
    except OSError as exc:
        raise CheckpointError(f"{manifest}: cannot be read ({exc.strerror}); without it the checkpoint cannot "
                              f"be verified") from None
    listed = {}
    for number, line in enumerate(text.splitlines(), 1):
        match = _MANIFEST_LINE.fullmatch(line)
        if not match:
            raise CheckpointError(f"{manifest}: line {number}: expected '<sha256>  <file>', got {line!r}")
        listed[match.group(2)] = match.group(1)
    present = set(_files(checkpoint))
    for name in sorted(set(listed) | present):  # only files found in the directory are read
        if name not in present:
            raise CheckpointError(f"{checkpoint / name}: listed in {MANIFEST} but missing")
        if name not in listed:
            raise CheckpointError(f"{checkpoint / name}: not in {MANIFEST}, so not part of the saved checkpoint")
        if sha256_file(checkpoint / name) != listed[name]:
            raise CheckpointError(f"{checkpoint / name}: sha256 differs from the one in {MANIFEST}: the file "
                                  f"changed after it was saved")


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
    ``latest`` update was lost, which nothing names: it is replaced. The files' sha256 go to
    SHA256SUMS, fsynced with them."""
    target = out / name
    staging = out / f"{name}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    write(staging)
    _write_manifest(staging)
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
    """Make ``out`` ready for a run: the checkpoint to resume from (``resume``; verified against
    its SHA256SUMS), or None for a new run, which needs an empty ``out`` unless ``overwrite`` (then
    the earlier run's ``latest`` and ``step-*`` go, ``latest`` first). Only the ``writer`` (rank 0)
    removes anything."""
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
    verify(out / name)
    if writer:
        _remove(out, _STAGING)  # saves a kill cut short
    return out / name
