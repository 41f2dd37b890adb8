"""The order in which ``verify`` reads chunk files, and what it says about one that fails (pure).

verify condemns a chunk file of a namespace it authenticates only after reading it: a file
whose frame authenticates with the deployment's key is never a finding, whatever its size. A
size is only a hint of where the authentic files are, learned from the files that
authenticated. The hint matters under a time bound (the crash-window check at launch): a
flood of garbage files named like the namespace's chunks must not use up the bound before
the authentic files are read, so that what is left unchecked is garbage, not the cache.

:class:`ReadOrder` hands out the files to read, one at a time, and learns from each result.
Files are keyed by ``(group, size)``, a group being a namespace prefix and KV world size
(one frame length each). The order:

1. the files named in ``first`` (the warm-set pins), in walk order;
2. the files of a key seen to authenticate after files of it had been set aside;
3. the walk order, except that a file whose key has failed (read, nothing of that key
   authenticated yet) is set aside: one failure of a size is enough to read the other
   sizes first (one garbage file of a common size does not make its 5,000 siblings go first);
4. the set-aside files, one key at a time in turn (round robin), so that a size holding
   authentic files among garbage of the same size is found; a key that authenticates goes
   back to (2);
5. the files of the groups verify does not authenticate (``plain``: serde none, no key,
   another namespace), in walk order.

Nothing here touches the filesystem.
"""

from __future__ import annotations

from collections import Counter, deque
from typing import Generic, TypeVar

T = TypeVar("T")
#: a namespace prefix and a KV world size: the files of one frame length
Group = tuple[str, int]
Key = tuple[Group, int]


class ReadOrder(Generic[T]):
    """Files to read, pins first, authentic sizes before sizes seen to fail (see the module).

    ``add`` every file (in walk order), then ``pop`` the next one and report each result with
    ``learned``. ``len()`` is the number of files not handed out yet."""

    def __init__(self) -> None:
        self._pinned: deque[T] = deque()
        self._walk: deque[tuple[Key, T]] = deque()
        self._promoted: deque[T] = deque()
        self._aside: dict[Key, deque[T]] = {}
        self._ring: deque[Key] = deque()
        self._plain: deque[T] = deque()
        self._ok: set[Key] = set()
        self._failed: set[Key] = set()

    def add(self, item: T, key: Key | None, *, pinned: bool = False) -> None:
        """Queue ``item``; ``key`` None for a file of a group verify does not authenticate."""
        if pinned:
            self._pinned.append(item)
        elif key is None:
            self._plain.append(item)
        else:
            self._walk.append((key, item))

    def learned(self, key: Key, authentic: bool) -> None:
        """A file of ``key`` was read: it authenticated (``authentic``) or not."""
        if authentic:
            if key in self._ok:
                return
            self._ok.add(key)
            if key in self._failed:
                self._failed.discard(key)
                self._promoted.extend(self._aside.pop(key, ()))
                if key in self._ring:
                    self._ring.remove(key)
        elif key not in self._ok and key not in self._failed:
            self._failed.add(key)
            self._aside[key] = deque()
            self._ring.append(key)

    def pop(self) -> T | None:
        """The next file to read, or None when every file was handed out."""
        if self._pinned:
            return self._pinned.popleft()
        if self._promoted:
            return self._promoted.popleft()
        while self._walk:
            key, item = self._walk.popleft()
            if key in self._failed:
                self._aside[key].append(item)
                continue
            return item
        while self._ring:
            key = self._ring[0]
            waiting = self._aside[key]
            if not waiting:
                self._ring.popleft()
                continue
            self._ring.rotate(-1)
            return waiting.popleft()
        if self._plain:
            return self._plain.popleft()
        return None

    def __len__(self) -> int:
        return (len(self._pinned) + len(self._promoted) + len(self._walk) + len(self._plain)
                + sum(len(q) for q in self._aside.values()))


def failed_verdict(size: int, authentic: Counter[int], usual: int | None) -> tuple[str, str]:
    """(kind, detail) of the finding about a file of ``size`` bytes that was read and fails
    AES-GCM authentication. ``authentic``: the sizes of its group's files that authenticated;
    ``usual``: its group's most common size (all files, authenticated or not), used only when
    none authenticated. The kind is ``size`` when the size differs from the expected one,
    else ``auth``."""
    fails = "and its frame fails AES-GCM authentication with the deployment's key"
    if authentic:
        if size not in authentic:
            want = authentic.most_common(1)[0][0]
            return "size", f"{size} bytes where this namespace's authenticated chunks have " \
                           f"{want}, {fails}"
    elif usual is not None and size != usual:
        return "size", f"{size} bytes where this namespace's chunks have {usual} (none " \
                       f"authenticates), {fails}"
    return "auth", ("frame fails AES-GCM authentication with the deployment's key (corrupt, "
                    "or another key)")
