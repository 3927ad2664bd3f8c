"""Host-side file access to a sandbox's work directory, safe against what a command left there.

A sandboxed command controls every name in its work directory: it may plant symbolic links to
host files, hard links to them (rlimits mode, same filesystem), FIFOs that block a reader,
directories nested thousands deep or without permissions, and may swap a directory for a link
while the host is using it. Everything here works relative to a directory file descriptor
opened when the session was made (never through the directory's path), and:

- resolves names with `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS |
  RESOLVE_NO_XDEV)`: the kernel refuses any link, any `..` out of the directory and any mount
  crossing, atomically. Where openat2 is missing (Linux < 5.6) a walk with `O_NOFOLLOW` and a
  device check on every component does the same, component by component;
- reads only regular files with one link (a hard link to a host file is refused);
- writes by creating a new file and renaming it into place: an existing name (a link, a FIFO, a
  hard link to a host file) is replaced, never written through;
- removes trees without recursion, holding one directory descriptor at a time, making
  unreadable directories readable on the way, and reports what it could not remove instead
  of raising (`remove_tree`).

Only the standard library (openat2 through ctypes).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import secrets
import stat
from pathlib import PurePosixPath
from typing import Iterator

# openat2(2): the same number on every architecture (the unified system call table).
_NR_OPENAT2 = 437
_RESOLVE_NO_XDEV = 0x01
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_NO_SYMLINKS = 0x04
_RESOLVE_BENEATH = 0x08
RESOLVE_FLAGS = _RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS | _RESOLVE_NO_MAGICLINKS | _RESOLVE_NO_XDEV


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                ("resolve", ctypes.c_uint64)]


@functools.lru_cache(maxsize=None)
def _libc() -> ctypes.CDLL:
    lib = ctypes.CDLL(None, use_errno=True)
    lib.syscall.restype = ctypes.c_long
    return lib


@functools.lru_cache(maxsize=None)
def openat2_available() -> bool:
    """Whether the kernel has openat2 with the resolve flags used here (probed once)."""
    fd = _openat2(os.open("/", os.O_PATH | os.O_DIRECTORY), ".", os.O_PATH, 0, close_dir=True)
    if isinstance(fd, OSError):
        return False
    os.close(fd)
    return True


def _openat2(dir_fd: int, path: str, flags: int, mode: int, close_dir: bool = False
             ) -> int | OSError:
    """openat2 with the resolve flags; the fd, or the OSError (ENOSYS where missing)."""
    # openat2 refuses a mode without O_CREAT / O_TMPFILE (open(2) ignores it)
    # (O_TMPFILE holds O_DIRECTORY's bit: compare it whole)
    creates = flags & os.O_CREAT or flags & os.O_TMPFILE == os.O_TMPFILE
    how = _OpenHow(flags | os.O_CLOEXEC, mode if creates else 0, RESOLVE_FLAGS)
    try:
        r = _libc().syscall(_NR_OPENAT2, dir_fd, os.fsencode(path), ctypes.byref(how),
                            ctypes.sizeof(how))
        e = ctypes.get_errno()
    finally:
        if close_dir:
            os.close(dir_fd)
    return r if r >= 0 else OSError(e, os.strerror(e), path)


def check_relpath(relpath: str | os.PathLike[str], what: str) -> tuple[str, ...]:
    """The components of a relative path inside a work directory (no '', '.', '..', no
    leading '/'); a ValueError naming `what` otherwise."""
    p = PurePosixPath(os.fspath(relpath))
    parts = p.parts
    if not parts or p.is_absolute() or any(x in ("..", ".") for x in parts) or \
            "\0" in os.fspath(relpath):
        raise ValueError(f"{what}: expected a relative path inside the work directory "
                         f"without '..', got {os.fspath(relpath)!r}")
    return parts


def _walk_open(root_fd: int, parts: tuple[str, ...], flags: int, mode: int) -> int:
    """The fallback resolver: one component at a time, no link followed, no mount crossed."""
    root_dev = os.fstat(root_fd).st_dev
    fd = os.dup(root_fd)
    try:
        for i, name in enumerate(parts):
            last = i == len(parts) - 1
            f = (flags if last else os.O_PATH | os.O_DIRECTORY) | os.O_NOFOLLOW | os.O_CLOEXEC
            nfd = os.open(name, f, mode, dir_fd=fd)
            if os.fstat(nfd).st_dev != root_dev:
                os.close(nfd)
                raise OSError(errno.EXDEV, "a mount point inside the work directory",
                              "/".join(parts))
            if stat.S_ISLNK(os.fstat(nfd).st_mode):  # O_PATH | O_NOFOLLOW opens the link
                os.close(nfd)
                raise OSError(errno.ELOOP, "a symbolic link", "/".join(parts[:i + 1]))
            os.close(fd)
            fd = nfd
        return fd
    except BaseException:
        os.close(fd)
        raise


def open_beneath(root_fd: int, relpath: str | os.PathLike[str], flags: int,
                 mode: int = 0o644, what: str = "Sandbox file path") -> int:
    """Open `relpath` under the directory `root_fd` without following any link, leaving it
    or crossing a mount; `flags` as for os.open (O_NOFOLLOW and O_CLOEXEC are added)."""
    parts = check_relpath(relpath, what)
    if openat2_available():
        fd = _openat2(root_fd, "/".join(parts), flags | os.O_NOFOLLOW, mode)
        if isinstance(fd, OSError):
            if fd.errno == errno.ELOOP:
                raise OSError(errno.ELOOP, "a symbolic link on the path (never followed)",
                              os.fspath(relpath))
            if fd.errno == errno.EXDEV:
                raise OSError(errno.EXDEV, "the path leaves the work directory or crosses "
                              "a mount", os.fspath(relpath))
            raise fd
        return fd
    return _walk_open(root_fd, parts, flags, mode)


def _open_parent(root_fd: int, parts: tuple[str, ...], create: bool, owner: tuple[int, int]
                 | None, what: str) -> int:
    """The directory holding the last component, created (and given to `owner`) as needed."""
    fd = os.dup(root_fd)
    try:
        for i, name in enumerate(parts[:-1]):
            if create:
                try:
                    os.mkdir(name, 0o755, dir_fd=fd)
                    if owner is not None:
                        nfd = open_beneath(fd, name, os.O_PATH | os.O_DIRECTORY, what=what)
                        try:
                            _chown_fd(nfd, owner)
                        finally:
                            os.close(nfd)
                except FileExistsError:
                    pass
            nfd = open_beneath(fd, name, os.O_RDONLY | os.O_DIRECTORY, what=what)
            os.close(fd)
            fd = nfd
        return fd
    except BaseException:
        os.close(fd)
        raise


def _chown_fd(fd: int, owner: tuple[int, int]) -> None:
    """fchown that also works on an O_PATH descriptor (through its /proc magic link)."""
    st = os.fstat(fd)
    if (st.st_uid, st.st_gid) == owner:
        return
    try:
        os.fchown(fd, *owner)
    except OSError as e:
        if e.errno != errno.EBADF:
            raise
        os.chown(f"/proc/self/fd/{fd}", *owner)


def read_file(root_fd: int, relpath: str | os.PathLike[str], limit: int,
              what: str = "Sandbox.read_file") -> bytes:
    """The bytes of a regular file with one link, at most `limit` (a ValueError beyond)."""
    fd = open_beneath(root_fd, relpath, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY,
                      what=f"{what}(relpath)")
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{what}(relpath): expected a regular file, got "
                             f"{os.fspath(relpath)!r} ({_kind(st.st_mode)})")
        if st.st_nlink != 1:
            raise ValueError(f"{what}(relpath): expected a file with one link, got "
                             f"{os.fspath(relpath)!r} with {st.st_nlink} (a hard link may "
                             "point at a host file)")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{what}: expected a file of at most {limit} bytes, got "
                         f"{os.fspath(relpath)!r} (larger)")
    return data


def write_file(root_fd: int, relpath: str | os.PathLike[str], data: bytes,
               owner: tuple[int, int] | None, what: str = "Sandbox.write_file") -> None:
    """Create or replace a file: written to a new file and renamed into place, so that no
    existing inode (a hard link to a host file, a FIFO) is ever written. Parents are
    created; new entries go to `owner` (uid, gid) so that the sandbox's user can change them.
    An existing regular file's permission bits are kept."""
    parts = check_relpath(relpath, f"{what}(relpath)")
    dfd = _open_parent(root_fd, parts, True, owner, f"{what}(relpath)")
    try:
        name = parts[-1]
        mode = 0o644
        try:
            old = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            if stat.S_ISDIR(old.st_mode):
                raise IsADirectoryError(errno.EISDIR, "a directory is there",
                                        os.fspath(relpath))
            if stat.S_ISREG(old.st_mode):
                mode = stat.S_IMODE(old.st_mode) & 0o777
        except FileNotFoundError:
            pass
        tmp = f".glm5-write-{secrets.token_hex(6)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600, dir_fd=dfd)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                if owner is not None:
                    _chown_fd(f.fileno(), owner)
                os.fchmod(f.fileno(), mode)
            os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=dfd)
            except OSError:
                pass
            raise
    finally:
        os.close(dfd)


def list_dir(root_fd: int, relpath: str | os.PathLike[str] = "",
             what: str = "Sandbox.list_dir") -> list[str]:
    """Sorted names in a directory of the work directory ('' for its top)."""
    if os.fspath(relpath) in ("", "."):
        fd = os.dup(root_fd)
    else:
        fd = open_beneath(root_fd, relpath, os.O_RDONLY | os.O_DIRECTORY,
                          what=f"{what}(relpath)")
    try:
        return sorted(os.listdir(fd))
    finally:
        os.close(fd)


def walk_files(root_fd: int, skip_dirs: frozenset[str] = frozenset(),
               max_entries: int = 100_000) -> Iterator[str]:
    """Relative paths of the regular files under the work directory, depth first, without
    recursion and without following links; directories named in `skip_dirs` are not entered.
    Stops (quietly) after `max_entries` entries: a command can make millions."""
    pending = [""]
    seen = 0
    while pending:
        rel = pending.pop()
        try:
            fd = os.dup(root_fd) if not rel else open_beneath(
                root_fd, rel, os.O_RDONLY | os.O_DIRECTORY, what="walk_files")
        except (OSError, ValueError):
            continue  # removed, unreadable or too long a path: not state
        try:
            with os.scandir(fd) as it:
                entries = sorted(((e.name, e.is_dir(follow_symlinks=False),
                                   e.is_file(follow_symlinks=False)) for e in it),
                                 reverse=True)
        except OSError:
            entries = []
        finally:
            os.close(fd)
        for name, is_dir, is_file in entries:
            seen += 1
            if seen > max_entries:
                return
            path = f"{rel}/{name}" if rel else name
            if is_dir:
                if name not in skip_dirs:
                    pending.append(path)
            elif is_file:
                yield path


def copy_in(root_fd: int, src: str | os.PathLike[str], dest: str | os.PathLike[str],
            owner: tuple[int, int] | None, ignore: frozenset[str] = frozenset()) -> int:
    """Copy a host file or directory tree to `dest` in the work directory: directories,
    regular files (their permission bits) and symbolic links (as links: they are only
    followed inside the sandbox); other file types and names in `ignore` are skipped. New
    entries go to `owner`. Iterative; returns the bytes copied. A full work directory raises
    OSError(ENOSPC)."""
    src = os.fspath(src)
    parts = check_relpath(dest, "Sandbox.copy_in(dest)")
    total = 0
    if not os.path.isdir(src):
        with open(src, "rb") as f:
            data = f.read()
        write_file(root_fd, "/".join(parts), data, owner, "Sandbox.copy_in")
        return len(data)
    top = _open_parent(root_fd, parts + ("x",), True, owner, "Sandbox.copy_in(dest)")
    os.close(top)
    stack = [(src, "/".join(parts))]
    while stack:
        hsrc, rel = stack.pop()
        dfd = open_beneath(root_fd, rel, os.O_RDONLY | os.O_DIRECTORY,
                           what="Sandbox.copy_in(dest)")
        try:
            with os.scandir(hsrc) as it:
                entries = sorted(it, key=lambda e: e.name)
            for e in entries:
                if e.name in ignore:
                    continue
                if e.is_symlink():
                    os.symlink(os.readlink(e.path), e.name, dir_fd=dfd)
                    if owner is not None:
                        os.chown(e.name, *owner, dir_fd=dfd, follow_symlinks=False)
                elif e.is_dir(follow_symlinks=False):
                    try:
                        os.mkdir(e.name, 0o755, dir_fd=dfd)
                    except FileExistsError:
                        pass
                    if owner is not None:
                        os.chown(e.name, *owner, dir_fd=dfd, follow_symlinks=False)
                    stack.append((e.path, f"{rel}/{e.name}"))
                elif e.is_file(follow_symlinks=False):
                    mode = stat.S_IMODE(e.stat(follow_symlinks=False).st_mode) & 0o777
                    fd = os.open(e.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                                 | os.O_CLOEXEC, 0o600, dir_fd=dfd)
                    with os.fdopen(fd, "wb") as out, open(e.path, "rb") as inp:
                        while chunk := inp.read(1 << 20):
                            out.write(chunk)
                            total += len(chunk)
                        out.flush()
                        if owner is not None:
                            os.fchown(out.fileno(), *owner)
                        os.fchmod(out.fileno(), mode)
        finally:
            os.close(dfd)
    return total


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symbolic link"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a regular file"


# ---------------------------------------------------------------------------- removal
def _open_dir_for_removal(parent_fd: int, name: str) -> int:
    """A read descriptor on the directory `name` (no link followed), made readable and
    writable first when a command took its permissions away."""
    try:
        return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                       dir_fd=parent_fd)
    except PermissionError:
        pass
    pfd = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                  dir_fd=parent_fd)
    try:
        os.chmod(f"/proc/self/fd/{pfd}", 0o700)  # this very inode, not a name
        return os.open(f"/proc/self/fd/{pfd}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    finally:
        os.close(pfd)


def remove_tree(parent_fd: int, name: str, label: str | None = None) -> list[str]:
    """Remove the entry `name` of the directory `parent_fd` and, if it is a directory,
    everything below it, without recursion: one descriptor is held at a time (a parent is
    reopened through '..' and checked to be the same inode), each directory's names are
    listed once, directories without permissions are given them back, and nothing is
    followed. Returns what could not be removed ("path: error"), [] when all went; never
    raises for an entry of the tree."""
    label = label or name
    problems: list[str] = []
    try:
        st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except FileNotFoundError:
        return []
    except OSError as e:
        return [f"{label}: {e.strerror}"]
    if not stat.S_ISDIR(st.st_mode):
        try:
            os.unlink(name, dir_fd=parent_fd)
        except OSError as e:
            problems.append(f"{label}: {e.strerror}")
        return problems
    try:
        cur = _open_dir_for_removal(parent_fd, name)
    except OSError as e:
        return [f"{label}: {e.strerror}"]
    # one frame per directory entered: (its name, its (dev, ino), names still to visit)
    frames: list[tuple[str, tuple[int, int], list[str]]] = []

    def enter(fd: int, dname: str) -> None:
        s = os.fstat(fd)
        if s.st_mode & 0o700 != 0o700 and s.st_uid == os.geteuid():
            try:  # a directory a command made read-only: its entries need write permission
                os.fchmod(fd, stat.S_IMODE(s.st_mode) | 0o700)
            except OSError:
                pass
        names: list[str] = []
        frames.append((dname, (s.st_dev, s.st_ino), names))
        try:
            names += os.listdir(fd)
        except OSError as e:
            problems.append(f"{_path()}: {e.strerror}")

    def _path() -> str:
        return "/".join([label] + [f[0] for f in frames[1:]])

    enter(cur, name)
    try:
        while frames:
            dname, ident, names = frames[-1]
            if names:
                child = names.pop()
                try:
                    cst = os.stat(child, dir_fd=cur, follow_symlinks=False)
                except FileNotFoundError:
                    continue
                except OSError as e:
                    problems.append(f"{_path()}/{child}: {e.strerror}")
                    continue
                if stat.S_ISDIR(cst.st_mode):
                    try:
                        nfd = _open_dir_for_removal(cur, child)
                    except OSError as e:
                        problems.append(f"{_path()}/{child}: {e.strerror}")
                        continue
                    os.close(cur)
                    cur = nfd
                    enter(cur, child)
                    continue
                try:
                    os.unlink(child, dir_fd=cur)
                except FileNotFoundError:
                    pass
                except OSError as e:
                    problems.append(f"{_path()}/{child}: {e.strerror}")
                continue
            # this directory is done: go up and remove it
            frames.pop()
            if not frames:
                os.close(cur)
                cur = -1
                try:
                    os.rmdir(name, dir_fd=parent_fd)
                except OSError as e:
                    problems.append(f"{label}: {e.strerror}")
                break
            up = os.open("..", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                         dir_fd=cur)
            s = os.fstat(up)
            os.close(cur)
            cur = up
            if (s.st_dev, s.st_ino) != frames[-1][1]:
                # the directory was moved while we were inside: stop here, never wander
                problems.append(f"{_path()}: moved during removal; stopped")
                break
            try:
                os.rmdir(dname, dir_fd=cur)
            except FileNotFoundError:
                pass
            except OSError as e:
                problems.append(f"{_path()}/{dname}: {e.strerror}")
    finally:
        if cur >= 0:
            os.close(cur)
    return problems
