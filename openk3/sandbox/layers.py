"""Snapshot layers on the host disk: copying a sandbox's writable overlay layer into a read-only one, and flattening a
chain of layers into one. Overlayfs (mounted with `userxattr`) reads exactly these things from a lower layer, and
both copies keep them: modes, owners, timestamps, symlinks, user xattrs, whiteouts (character devices 0/0: a deleted
file) and opaque folders (`user.overlay.opaque=y`: a folder that hides the one below it). Hardlinks become copies;
sparse files stay sparse. Runs in the supervisor (root of its user namespace, so owners are kept as they are mapped).

Stdlib only and no sibling imports: the supervisor loads this file as a top-level module.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat

OPAQUE = "user.overlay.opaque"
_CHUNK = 1 << 30


def _is_whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def _is_opaque(path: str) -> bool:
    try:
        return os.getxattr(path, OPAQUE, follow_symlinks=False) == b"y"
    except OSError:
        return False


def _copy_data(src: str, dst: str, st: os.stat_result) -> None:
    """Copy a regular file's bytes, extent by extent (SEEK_DATA/SEEK_HOLE), so holes stay holes."""
    fin = os.open(src, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        fout = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fout, st.st_size)
            pos = 0
            while pos < st.st_size:
                try:
                    start = os.lseek(fin, pos, os.SEEK_DATA)
                except OSError as e:
                    if e.errno == errno.ENXIO:  # only a hole is left
                        break
                    raise
                end = os.lseek(fin, start, os.SEEK_HOLE)
                os.lseek(fout, start, os.SEEK_SET)
                while start < end:
                    n = os.sendfile(fout, fin, start, min(end - start, _CHUNK))
                    if n == 0:  # the file shrank under us; the rest stays a hole
                        end = start
                    start += n
                pos = end
        finally:
            os.close(fout)
    finally:
        os.close(fin)


def _copy_meta(src: str, dst: str, st: os.stat_result, keep_opaque: bool) -> None:
    """Owner, mode (after chown, which clears set-id bits), user xattrs, then timestamps (last: the others touch
    ctime only, but a folder's mtime moves while its entries are written, so folders get theirs after their entries)."""
    link = stat.S_ISLNK(st.st_mode)
    os.chown(dst, st.st_uid, st.st_gid, follow_symlinks=False)
    if not link:
        os.chmod(dst, stat.S_IMODE(st.st_mode))
        for name in os.listxattr(src, follow_symlinks=False):
            # overlay's own bookkeeping (origin, impure, ...) describes the upper layer it came from; only the
            # opaque mark means something in a lower layer
            if name.startswith("user.") and (not name.startswith("user.overlay.") or (keep_opaque and name == OPAQUE)):
                os.setxattr(dst, name, os.getxattr(src, name, follow_symlinks=False), follow_symlinks=False)
    os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)


def _copy_entry(src: str, dst: str, st: os.stat_result) -> int:
    """Copy one entry (a folder recursively); returns the bytes of file data written."""
    mode = st.st_mode
    if stat.S_ISDIR(mode):
        os.mkdir(dst, 0o700)
        size = sum(
            _copy_entry(e.path, os.path.join(dst, e.name), e.stat(follow_symlinks=False)) for e in os.scandir(src)
        )
        _copy_meta(src, dst, st, keep_opaque=True)
        return size
    if stat.S_ISREG(mode):
        _copy_data(src, dst, st)
    elif stat.S_ISLNK(mode):
        os.symlink(os.readlink(src), dst)
    elif _is_whiteout(st):
        os.mknod(dst, stat.S_IFCHR, 0)  # a user namespace may create this one device: overlay's deletion mark
    elif stat.S_ISFIFO(mode):
        os.mkfifo(dst, 0o600)
    else:
        return 0  # sockets and devices: nothing a snapshot can carry (the sandbox user cannot make devices)
    _copy_meta(src, dst, st, keep_opaque=False)
    return st.st_blocks * 512 if stat.S_ISREG(mode) else 0


def copy_layer(upper: str, dst: str) -> int:
    """Copy the writable layer `upper` into the new layer folder `dst` (written as `dst.tmp`, then renamed, so a
    layer folder is whole or absent). Returns its data bytes."""
    tmp = dst + ".tmp"
    try:
        size = _copy_entry(upper, tmp, os.lstat(upper))
        os.rename(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return size


def _merge(srcs: list[str], dst: str, hides_below: bool) -> int:
    """Write into `dst` the merged view of folders `srcs` (topmost first, all folders at the same path of their
    layers), keeping whiteouts and opaque marks wherever they hide something of the base image below the chain."""
    top = os.lstat(srcs[0])
    os.mkdir(dst, 0o700)
    names = {}
    for i, s in enumerate(srcs):
        for e in os.scandir(s):
            names.setdefault(e.name, i)
    size = 0
    for name, i in sorted(names.items()):
        path = os.path.join(srcs[i], name)
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode):
            size += _copy_entry(path, os.path.join(dst, name), st)  # a file, link or whiteout: the top one wins
            continue
        sub, cut = [path], _is_opaque(path)
        for lower in srcs[i + 1 :]:
            if cut:
                break
            try:
                lst = os.lstat(os.path.join(lower, name))
            except FileNotFoundError:
                continue
            if stat.S_ISDIR(lst.st_mode):
                sub.append(os.path.join(lower, name))
                cut = _is_opaque(sub[-1])
            else:
                cut = True  # a whiteout or a file below a folder: nothing further down shows through
        size += _merge(sub, os.path.join(dst, name), cut)
    _copy_meta(srcs[0], dst, top, keep_opaque=False)
    if hides_below:
        os.setxattr(dst, OPAQUE, b"y")
    return size


def flatten(layers_top_first: list[str], dst: str) -> int:
    """One layer equal to the chain `layers_top_first` stacked on any base image. Returns its data bytes."""
    srcs, cut = [], False
    for layer in layers_top_first:  # the roots merge like any folder: an opaque one hides the rest
        srcs.append(layer)
        if cut := _is_opaque(layer):
            break
    tmp = dst + ".tmp"
    try:
        size = _merge(srcs, tmp, hides_below=cut)
        os.rename(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return size
