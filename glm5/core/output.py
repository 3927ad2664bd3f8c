"""Writing outputs so that nothing is lost or mixed: `save_pretrained`, `glm5 quantize` and
`glm5 export` write into a temporary directory beside the target and then move the result into
place with one rename.

- A reader of the target sees the old output or the new one, never a mixture: a directory is
  swapped whole (Linux: one `renameat2(RENAME_EXCHANGE)`; elsewhere two renames, between which
  the target is briefly absent, never mixed).
- An interrupted or failed write loses nothing: the target is untouched until the final rename,
  and the temporary directory (and any parent directory the write created) is removed. A
  process killed outright (SIGKILL, power loss) can leave a hidden `.NAME.tmp-*` directory
  beside the target; it is never read and may be deleted.
- Files of an earlier output that the new write does not produce (stale shards, an old index)
  are gone, because the directory is replaced, not written into. Files that are not part of
  the output (a tokenizer, a README) are carried into the new directory (hard links).
- An existing output is replaced only when asked (``overwrite=True``, `--force`).

The new directory takes the same disk space as the old one until the swap.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterator


class OutputExistsError(FileExistsError):
    """The target already holds an output and ``overwrite`` was not given.

    ``path`` is the existing target and ``what`` says what it holds, so that a command line can
    name its own flag (`--force`) instead of the keyword argument.
    """

    def __init__(self, who: str, path: Path, what: str) -> None:
        self.who, self.path, self.what = who, path, what
        super().__init__(f"{who}: {path} {what}; pass overwrite=True to replace it")


class OutputPathError(ValueError):
    """The output path names the wrong kind of thing: a file where a directory is to be written
    (the target or one of its parents), or a directory where a file is."""


def _target(path: str | os.PathLike[str]) -> Path:
    p = Path(path).expanduser()
    # A symlinked target is written where it points: the temporary directory then lives on the
    # same filesystem as the data it replaces (rename needs that) and the link survives.
    return p.resolve() if p.is_symlink() else p.absolute()


def _make_parents(target: Path, who: str) -> list[Path]:
    """`mkdir -p` of the target's parent; returns the directories created (outermost first) so
    that a failed write can remove them again."""
    created: list[Path] = []
    for d in reversed([target.parent, *target.parent.parents]):
        if d.is_dir():
            continue
        if d.exists():
            raise OutputPathError(f"{who}: {d} is a file, expected a directory (it is part "
                                     f"of the output path {target})")
        d.mkdir()
        created.append(d)
    return created


def _remove_created(created: list[Path]) -> None:
    for d in reversed(created):
        try:
            d.rmdir()
        except OSError:
            break


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on a directory; the rename is still atomic
        pass
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """Flush every file to disk before the rename publishes it: after a power loss the target
    is then the old output or the complete new one, not new names over unwritten data."""
    for dirpath, _, files in os.walk(root):
        for f in files:
            fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths in one step (Linux renameat2 RENAME_EXCHANGE). False where the
    platform, libc or filesystem cannot; then the caller renames twice."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _carry(old: Path, new: Path, replaces: Callable[[str], bool]) -> None:
    """Bring into ``new`` what ``old`` holds beside the output (entries ``replaces`` rejects and
    the write did not produce), so that replacing the directory loses nothing else."""
    for e in old.iterdir():
        dst = new / e.name
        if replaces(e.name) or dst.exists() or dst.is_symlink():
            continue
        if e.is_symlink():
            os.symlink(os.readlink(e), dst)
        elif e.is_dir():
            shutil.copytree(e, dst, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(str(e), str(dst))


def _check_dir(target: Path, overwrite: bool, who: str, replaces: Callable[[str], bool],
               kind: str) -> None:
    if target.exists() and not target.is_dir():
        raise OutputPathError(f"{who}: {target} is a file, expected a directory (new, empty, "
                                 f"or an earlier output to replace)")
    if overwrite or not target.is_dir():
        return
    held = sorted(e.name for e in target.iterdir() if replaces(e.name))
    if held:
        more = f", ... ({len(held)} files)" if len(held) > 3 else ""
        raise OutputExistsError(who, target, f"already holds {kind} ({', '.join(held[:3])}"
                                             f"{more})")


def _scratch_beside(target: Path, who: str) -> tuple[Path, list[Path]]:
    """A fresh temporary directory beside ``target`` (same filesystem: the final rename is
    atomic), creating missing parents; returns it and the parents it created."""
    created = _make_parents(target, who)
    try:
        return Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent)), created
    except BaseException:
        _remove_created(created)
        raise


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike[str], *, overwrite: bool, who: str,
               replaces: Callable[[str], bool], kind: str = "an output") -> Iterator[Path]:
    """Write the directory ``path`` atomically: yields an empty temporary directory beside it;
    when the block returns, that directory replaces ``path`` in one rename.

    ``replaces(name)`` says which entries of the directory the write owns (e.g. config.json and
    every ``*.safetensors``): an existing ``path`` holding any of them is refused unless
    ``overwrite``; entries it does not own are carried into the new directory. ``who`` prefixes
    error messages and ``kind`` names what the directory holds in them ("a checkpoint"). If the
    block raises, ``path`` is untouched and nothing is left behind.
    """
    target = _target(path)
    _check_dir(target, overwrite, who, replaces, kind)
    tmp, created = _scratch_beside(target, who)
    try:
        yield tmp
        _check_dir(target, overwrite, who, replaces, kind)  # again: it may have appeared meanwhile
        if target.is_dir():
            _carry(target, tmp, replaces)
        _fsync_tree(tmp)
        if not target.exists():
            os.rename(tmp, target)
        elif not _exchange(tmp, target):
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            old.rmdir()
            os.rename(target, old)
            try:
                os.rename(tmp, target)
            except BaseException:
                os.rename(old, target)
                raise
            tmp = old
        _fsync_dir(target.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_created(created)
        raise
    shutil.rmtree(tmp, ignore_errors=True)  # after a swap: the previous output


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike[str], *, overwrite: bool, who: str) -> Iterator[Path]:
    """Write the file ``path`` atomically: yields a path of the same name in a temporary
    directory beside it; when the block returns, the file (and any file the writer put beside
    it there, e.g. ONNX external data) is renamed into place, the named file last.

    An existing file (or side file) is refused unless ``overwrite``; a directory at ``path`` is
    an `OutputPathError`. If the block raises, nothing is left behind.
    """
    target = _target(path)
    if target.is_dir():
        raise OutputPathError(f"{who}: {target} is a directory, expected a file path")
    if target.exists() and not overwrite:
        raise OutputExistsError(who, target, "exists")
    tmp, created = _scratch_beside(target, who)
    try:
        yield tmp / target.name
        if not (tmp / target.name).is_file():
            raise FileNotFoundError(f"{who}: the writer produced no file {target.name}")
        if target.exists() and not overwrite:
            raise OutputExistsError(who, target, "exists")
        side = [e for e in tmp.iterdir() if e.name != target.name]
        for e in side:
            if (target.parent / e.name).exists() and not overwrite:
                raise OutputExistsError(who, target.parent / e.name, "exists")
        _fsync_tree(tmp)
        for e in [*side, tmp / target.name]:
            os.replace(e, target.parent / e.name)
        _fsync_dir(target.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_created(created)
        raise
    shutil.rmtree(tmp, ignore_errors=True)
