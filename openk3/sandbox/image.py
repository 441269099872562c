"""The base image a sandbox's overlay stands on: by default a skeleton root built once per backend (a few /etc files,
the sandbox user's /workspace, /tmp, merged-/usr links; the host's /usr is bound read-only over its empty usr/ at
mount time), or a root filesystem folder the user names.

Owners follow the sandboxes' uid map (inside 0 -> host 0, inside 1..65535 -> host 100001..165535): the sandbox user,
inside uid 1000, owns /workspace as host uid 101000. A named image should use the same shift.
"""

from __future__ import annotations

import os
import shutil

SANDBOX_UID = 1000  # the unprivileged user commands run as, inside
HOST_SHIFT = 100_000  # inside uid u (1..65535) is host uid u + HOST_SHIFT
HOST_UID = SANDBOX_UID + HOST_SHIFT

_FILES = {
    "etc/passwd": "root:x:0:0:root:/root:/bin/sh\nsandbox:x:1000:1000:sandbox:/workspace:/bin/sh\n"
    "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
    "etc/group": "root:x:0:\nsandbox:x:1000:\nnogroup:x:65534:\n",
    "etc/hosts": "127.0.0.1\tlocalhost sandbox\n::1\tlocalhost ip6-localhost ip6-loopback\n",
    "etc/hostname": "sandbox\n",
    "etc/nsswitch.conf": "passwd: files\ngroup: files\nshadow: files\nhosts: files\nnetworks: files\n",
    "etc/resolv.conf": "# no network: a sandbox has its own loopback only\n",
}
_MERGED_USR = ("bin", "lib", "lib64", "sbin")


def has_own_usr(root: str) -> bool:
    """A named image with its own /usr/bin gets no bind of the host's /usr."""
    return os.path.isdir(os.path.join(root, "usr", "bin"))


def check_image(root: str) -> str:
    """The absolute path of a named base image, validated for use as an overlay lower layer."""
    root = os.path.abspath(root)
    if not os.path.isdir(root):
        raise ValueError(f"base_image={root!r}: not a folder")
    if any(c in root for c in ":,\\"):
        raise ValueError(f"base_image={root!r}: ':', ',' and '\\' cannot appear in an overlay lowerdir path")
    for sub in ("proc", "dev", "tmp"):
        if not os.path.isdir(os.path.join(root, sub)):
            raise ValueError(f"base_image={root!r}: has no {sub}/ folder (a sandbox mounts its own {sub} there)")
    if not has_own_usr(root) and not os.path.isdir(os.path.join(root, "usr")):
        raise ValueError(f"base_image={root!r}: has neither usr/bin nor an empty usr/ to bind the host's /usr on")
    return root


def build_skeleton(root: str) -> str:
    """Write the default base image at `root` (a fresh folder) and return it."""
    tmp = root + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp, mode=0o755)
    os.chmod(tmp, 0o755)
    for d in ("etc", "usr", "proc", "dev", "root", "var", "var/tmp", "run", "home", "workspace", "tmp", "mnt", "opt"):
        os.makedirs(os.path.join(tmp, d), mode=0o755, exist_ok=True)
    for path, text in _FILES.items():
        with open(os.path.join(tmp, path), "w") as f:
            f.write(text)
    for name in _MERGED_USR:  # Debian 12 is merged-/usr: /bin and friends live in the bound /usr
        os.symlink(os.path.join("usr", name), os.path.join(tmp, name))
    # Debian's /usr/bin links through /etc/alternatives (awk, pager, ...) and the loader's cache names /usr libraries.
    if os.path.isdir("/etc/alternatives"):
        os.mkdir(os.path.join(tmp, "etc", "alternatives"))
        for e in os.scandir("/etc/alternatives"):
            if e.is_symlink():
                os.symlink(os.readlink(e.path), os.path.join(tmp, "etc", "alternatives", e.name))
    if os.path.isfile("/etc/ld.so.cache"):
        shutil.copyfile("/etc/ld.so.cache", os.path.join(tmp, "etc", "ld.so.cache"))
    os.chmod(os.path.join(tmp, "root"), 0o700)
    for d in ("tmp", "var/tmp"):
        os.chmod(os.path.join(tmp, d), 0o1777)
    os.chown(os.path.join(tmp, "workspace"), HOST_UID, HOST_UID)
    os.rename(tmp, root)
    return root
