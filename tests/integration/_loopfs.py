"""Real ext4 and XFS filesystems for tests: a sparse image file, loop-mounted.

Usage::

    with loop_filesystem("xfs", tmp_path / "fs") as fs:
        fs.fill()                       # another file takes every free block: ENOSPC
        fs.remount(read_only=True)      # EROFS for every write
        fs.remount(read_only=False)
        fs.unfill()                     # the space comes back

Needs root (``mount``) and the mkfs of the filesystem (``mkfs.ext4`` from e2fsprogs,
``mkfs.xfs`` from xfsprogs: scripts/setup.sh installs both); without them the test fails,
it is never skipped. On exit the filesystem is always unmounted, whatever happened (a lazy
unmount as the last resort), its loop device detached and the image deleted; processes
that still hold files there must be stopped first (``Stack.cleanup``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

#: the image size: mkfs.xfs refuses less than 300 MiB, and ``kvp-admin launch`` refuses a
#: cache root with less than 256 MiB free (kvpersist/stack/preflight.py)
IMAGE_MIB = 512
#: mkfs per filesystem and the package that has it. ext4 without the 5% reserved for root:
#: the test server runs as root and would write into it, where the service user could not.
MKFS = {"ext4": (["mkfs.ext4", "-q", "-F", "-m", "0"], "e2fsprogs"),
        "xfs": (["mkfs.xfs", "-q", "-f"], "xfsprogs")}
FILLER = ".filler"


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} -> {r.returncode}: {r.stderr.strip()}")
    return r


def _tool(name: str, package: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed: scripts/setup.sh installs it "
                    f"(apt-get install {package})", pytrace=False)
    return path


@dataclass
class LoopFs:
    """A mounted loop filesystem: its type, image and mount point."""

    fstype: str
    image: Path
    mountpoint: Path

    def statvfs(self) -> os.statvfs_result:
        return os.statvfs(self.mountpoint)

    @property
    def avail_bytes(self) -> int:
        sv = self.statvfs()
        return sv.f_bavail * sv.f_frsize

    @property
    def read_only(self) -> bool:
        return bool(self.statvfs().f_flag & os.ST_RDONLY)

    def fill(self) -> int:
        """Allocate every free block to one file (``fallocate``, as another program that
        fills the disk would write it); return the bytes allocated. Afterwards a write that
        needs a new block fails with ENOSPC."""
        fd = os.open(self.mountpoint / FILLER, os.O_WRONLY | os.O_CREAT, 0o600)
        offset, step = 0, max(self.avail_bytes, 4096)
        try:
            while step >= 4096:
                try:
                    os.posix_fallocate(fd, offset, step)
                    offset += step
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    step //= 2
        finally:
            os.close(fd)
        return offset

    def unfill(self) -> None:
        """Delete the file :meth:`fill` made (the space comes back)."""
        (self.mountpoint / FILLER).unlink()

    def remount(self, *, read_only: bool) -> None:
        """``mount -o remount,ro`` (or ``rw``). A read-only remount waits while a file is
        open for writing (EBUSY), up to 10 s."""
        deadline = time.monotonic() + 10
        while True:
            r = _run("mount", "-o", "remount," + ("ro" if read_only else "rw"),
                     str(self.mountpoint), check=False)
            if r.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        if r.returncode != 0 or self.read_only != read_only:
            raise RuntimeError(f"remount {'ro' if read_only else 'rw'} of {self.mountpoint} "
                               f"failed: {r.stderr.strip()}")


def _loop_devices(image: Path) -> list[str]:
    """The loop devices bound to ``image`` (``losetup -j``)."""
    return [line.split(":", 1)[0] for line in
            _run("losetup", "-j", str(image), check=False).stdout.splitlines()]


def _mounted(path: Path, mountinfo: Path = Path("/proc/self/mountinfo")) -> bool:
    """Whether something is mounted at ``path`` in the mount namespace of ``mountinfo``
    (``os.path.ismount`` misses a bind mount of a directory onto itself)."""
    try:
        text = mountinfo.read_text()
    except OSError:
        return False
    return any(line.split()[4] == str(path) for line in text.splitlines())


def _holders(mountpoint: Path) -> list[int]:
    """Pids whose mount namespace still has a mount at ``mountpoint`` (a copy made when a
    process entered a new mount namespace with private propagation)."""
    return [int(mi.parent.name) for mi in Path("/proc").glob("[0-9]*/mountinfo")
            if _mounted(mountpoint, mi)]


def _unmount(workdir: Path, mountpoint: Path, image: Path) -> None:
    """Unmount the filesystem (a lazy unmount when busy) and the shared bind mount of
    ``workdir`` under it, detach the loop device, delete the image. Warns (naming the
    processes) when the loop device stays bound: a copy of the mount in another mount
    namespace that does not receive unmounts holds it until those processes end."""
    for path in (mountpoint, workdir):
        for _ in range(3):  # a mount stacked on another needs a second unmount
            if not _mounted(path):
                break
            if _run("umount", str(path), check=False).returncode != 0:
                _run("umount", "-l", str(path), check=False)
    # `mount -o loop` sets autoclear: the device goes with the last unmount; detach
    # explicitly whatever is still bound to the image
    for dev in _loop_devices(image):
        _run("losetup", "-d", dev, check=False)
    deadline = time.monotonic() + 5
    while _loop_devices(image) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = _loop_devices(image)
    if left:
        holders = _holders(mountpoint)
        why = (f"mounts of it remain in the mount namespaces of pids {holders}" if holders
               else "it was unmounted lazily: a process still uses a file or directory on it")
        warnings.warn(f"{', '.join(left)} stays bound to {image}: {why} (freed when they end)",
                      stacklevel=1)
    with contextlib.suppress(FileNotFoundError):
        image.unlink()


@contextlib.contextmanager
def loop_filesystem(fstype: str, workdir: Path) -> Iterator[LoopFs]:
    """A fresh ``fstype`` filesystem of :data:`IMAGE_MIB` MiB mounted at
    ``workdir/mnt``; always unmounted and deleted on exit.

    ``workdir`` is first bind-mounted onto itself and made a shared mount, with the
    filesystem mounted below it: a process that enters a new mount namespace meanwhile
    (``ip netns exec`` makes its copy a slave) receives the unmount, so its copy does not
    keep the loop device bound after the test."""
    if os.geteuid() != 0:
        pytest.fail("loop mounts need root: run the integration lane as root", pytrace=False)
    argv, package = MKFS[fstype]
    _tool(argv[0], package)
    for name, pkg in (("mount", "mount"), ("umount", "mount"), ("losetup", "mount")):
        _tool(name, pkg)
    workdir.mkdir(parents=True, exist_ok=True)
    image, mountpoint = workdir / f"{fstype}.img", workdir / "mnt"
    mountpoint.mkdir()
    with image.open("wb") as f:
        f.truncate(IMAGE_MIB << 20)
    try:
        _run("mount", "--bind", str(workdir), str(workdir))
        _run("mount", "--make-shared", str(workdir))
        _run(*argv, str(image))
        _run("mount", "-o", "loop", "-t", fstype, str(image), str(mountpoint))
        yield LoopFs(fstype, image, mountpoint)
    finally:
        _unmount(workdir, mountpoint, image)
