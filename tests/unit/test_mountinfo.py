"""``superblock_read_only`` (pure): the filesystem's own read-only state from
/proc/self/mountinfo's super options, at the deepest mount point above a path — what tells a
read-only sandbox view (systemd's ProtectSystem=strict, a read-only bind mount) from a
filesystem that is read-only in itself (a remount, ext4 after I/O errors)."""

from __future__ import annotations

import pytest

from kvpersist.system.files import superblock_read_only

MOUNTINFO = """\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
30 22 7:0 / /srv/nvme ro,nosuid,relatime shared:5 - ext4 /dev/loop0 rw
31 22 7:1 / /srv/bad ro,relatime shared:6 - ext4 /dev/loop1 ro,errors=remount-ro
32 30 7:0 /kv /srv/nvme/kv ro,relatime - ext4 /dev/loop0 rw,data=ordered
33 22 0:40 / /srv/with\\040space ro - tmpfs tmpfs ro,size=1024k
"""


@pytest.mark.parametrize(("path", "expected"), [
    ("/srv/nvme/cache/demo", False),     # read-only view of a read-write filesystem
    ("/srv/nvme/kv/ns", False),          # the deepest mount point wins (a bind inside)
    ("/srv/bad/cache", True),            # read-only in itself
    ("/srv/nvmex", False),               # a name that only starts like a mount point: /
    ("/", False),
    ("/srv/with space/x", True),         # mountinfo's octal escapes
])
def test_the_deepest_mount_points_super_options_decide(path: str, expected: bool) -> None:
    assert superblock_read_only(MOUNTINFO, path) is expected


@pytest.mark.parametrize("text", ["", "garbage line\n", "1 2 3 4 /x rw - ext4\n"])
def test_unreadable_or_unmatched_text_is_unknown(text: str) -> None:
    assert superblock_read_only(text, "/x/y") is None
