"""The mounts of one sandbox, made by its supervisor inside the sandbox's own mount namespace (the host never sees
them; they vanish with the namespace). Under the backend's `mnt/` folder, which every sandbox mounts over privately:

    mnt/dev    small tmpfs: the host's null, zero, full, random, urandom bound in, fd/stdin/... links (made once)
    mnt/disk   the writable layer's tmpfs (size = disk_mb): upper/ and overlay's work/ (replaced on snapshot/restore)
    mnt/root   the overlay: lowerdir = the snapshot chain's layers, top first, then the base image; upper on mnt/disk;
               inside it, the host /usr bound read-only (default image), a fresh proc (the sandbox's PID namespace,
               hidepid: the supervisor, PID 1, is invisible to the sandbox user) and mnt/dev

Stdlib only; the supervisor loads this file as a top-level module beside `linux`.
"""

from __future__ import annotations

import os

import linux as L

_DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
_LINKS = {"fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1",
          "stderr": "/proc/self/fd/2", "shm": "/tmp"}  # fmt: skip
_NOSUID = L.MS_NOSUID | L.MS_NODEV
MAX_OPTIONS = 4000  # the mount(2) data page is 4096 bytes; the chain bound keeps lowerdir far below it


class RootFs:
    def __init__(self, cfg: dict, chain: list[str]):
        self.mnt, self.layers_dir, self.base = cfg["mnt"], cfg["layers"], cfg["base"]
        self.bind_usr, self.disk_mb, self.inodes = cfg["bind_usr"], cfg["disk_mb"], cfg["inodes"]
        self.dev, self.disk, self.root = (os.path.join(self.mnt, d) for d in ("dev", "disk", "root"))
        self.upper = os.path.join(self.disk, "upper")
        self.chain = list(chain)  # layer ids, bottom first
        self.root_mounted = self.disk_mounted = False

    def setup(self) -> None:
        os.chdir(self.layers_dir)  # lowerdir names layers relative to here: short mount options
        L.mount("tmpfs", self.dev, "tmpfs", L.MS_NOSUID | L.MS_NOEXEC, "size=64k,nr_inodes=64,mode=755")
        for name in _DEVICES:
            host = os.path.join("/dev", name)
            if os.path.exists(host):
                target = os.path.join(self.dev, name)
                open(target, "w").close()
                try:
                    L.mount(host, target, None, L.MS_BIND)
                except OSError:
                    os.unlink(target)  # /dev/tty without a controlling terminal to lend, say
        for name, target in _LINKS.items():
            os.symlink(target, os.path.join(self.dev, name))
        self.mount()

    def _mount_disk(self) -> None:
        opts = f"size={self.disk_mb}m,nr_inodes={self.inodes},mode=755"
        L.mount("tmpfs", self.disk, "tmpfs", _NOSUID, opts)
        os.mkdir(self.upper)
        os.mkdir(os.path.join(self.disk, "work"))
        st = os.stat(self.base)  # the overlay's root folder takes the upper layer's root: match the image's
        os.chown(self.upper, st.st_uid, st.st_gid)
        os.chmod(self.upper, st.st_mode & 0o7777)
        self.disk_mounted = True

    def mount_root(self) -> None:
        """The overlay of the current chain and writable layer, with /usr, /proc and /dev inside it."""
        lower = ":".join([*reversed(self.chain), self.base])
        opts = f"lowerdir={lower},upperdir={self.upper},workdir={self.disk}/work,userxattr"
        if len(opts) > MAX_OPTIONS:
            raise OSError(f"overlay options are {len(opts)} bytes for {len(self.chain)} layers (limit {MAX_OPTIONS})")
        L.mount("overlay", self.root, "overlay", _NOSUID, opts)
        self.root_mounted = True
        if self.bind_usr:
            L.bind("/usr", os.path.join(self.root, "usr"))
        L.mount("proc", os.path.join(self.root, "proc"), "proc", _NOSUID | L.MS_NOEXEC, "hidepid=invisible")
        L.mount(self.dev, os.path.join(self.root, "dev"), None, L.MS_BIND | L.MS_REC)

    def mount(self) -> None:
        self._mount_disk()
        self.mount_root()

    def detach_root(self) -> None:
        """Detach the overlay with everything mounted inside it; the writable layer stays on its tmpfs."""
        if self.root_mounted:
            L.umount(self.root)
            self.root_mounted = False

    def remount(self, chain: list[str]) -> None:
        """A fresh, empty writable layer over `chain`: O(1) in what the sandbox holds (the old tmpfs's pages go)."""
        self.detach_root()
        if self.disk_mounted:
            L.umount(self.disk)
            self.disk_mounted = False
        self.chain = list(chain)
        self.mount()

    def upper_empty(self) -> bool:
        return not os.listdir(self.upper)

    def processes(self) -> list[int]:
        """The sandbox's processes, its supervisor (PID 1) aside, from its own /proc."""
        return sorted(int(n) for n in os.listdir(os.path.join(self.root, "proc")) if n.isdigit() and n != "1")

    def describe(self, pids: list[int]) -> str:
        out = []
        for pid in pids[:8]:
            try:
                with open(os.path.join(self.root, "proc", str(pid), "cmdline"), "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:
                cmd = "?"
            out.append(f"{pid} ({cmd[:60]})")
        return ", ".join(out) + (f" and {len(pids) - 8} more" if len(pids) > 8 else "")

    def disk_usage(self) -> tuple[int, bool]:
        """(bytes used on the writable layer, whether it is full: no block or no inode left)."""
        st = os.statvfs(self.disk)
        return (st.f_blocks - st.f_bfree) * st.f_frsize, st.f_bavail == 0 or st.f_favail == 0
