"""The cache directory is its owner's alone: 0700 directories, 0600 files, whatever the umask.

Anyone who can read the cache reads the prompts' KV (and its keys); anyone who can open ``agent.lock`` can
hold its flock and keep every agent out. New files and directories are created with these modes (a umask
can only take bits away), and a cache made by an older release is tightened when it is opened
(`make_private`): the directory itself, every directory in it and the files that name the node's processes
and index. Chunk files made earlier keep their mode: the 0700 directories above them already keep everyone
else out, and a cache may hold millions of them.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

__all__ = ["PRIVATE_DIR", "PRIVATE_FILE", "make_private", "private_dir", "tighten"]

PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600
# Folders of the cache whose whole contents are tightened at open (few entries each).
_SMALL_FOLDERS = ("index", "engines", "writers")


def private_dir(path: str | os.PathLike[str]) -> Path:
    """``path`` made (with its missing parents) and tightened to 0700."""
    directory = Path(path)
    directory.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
    tighten(directory)
    return directory


def tighten(path: str | os.PathLike[str]) -> None:
    """0700 for a directory, 0600 for anything else, if it is ours and looser (never follows a symlink).
    Best effort: a file that went meanwhile, or one another user owns, is left as it is."""
    with contextlib.suppress(OSError):
        found = os.lstat(path)
        if stat.S_ISLNK(found.st_mode) or found.st_uid != os.geteuid():
            return
        wanted = PRIVATE_DIR if stat.S_ISDIR(found.st_mode) else PRIVATE_FILE
        if stat.S_IMODE(found.st_mode) != wanted:
            os.chmod(path, wanted)


def make_private(cache_dir: str | os.PathLike[str]) -> None:
    """Tighten a cache directory made by an older release (or under a loose umask) to its owner alone."""
    root = Path(cache_dir)
    tighten(root)
    with contextlib.suppress(OSError), os.scandir(root) as entries:
        for entry in entries:
            tighten(entry.path)
            if entry.name in _SMALL_FOLDERS or entry.name == "chunks":
                _tighten_contents(Path(entry.path), files=entry.name != "chunks")


def _tighten_contents(folder: Path, *, files: bool) -> None:
    with contextlib.suppress(OSError), os.scandir(folder) as entries:
        for entry in entries:
            if files or entry.is_dir(follow_symlinks=False):
                tighten(entry.path)
