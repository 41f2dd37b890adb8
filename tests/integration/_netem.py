"""A userspace stand-in for ``tc qdisc ... netem delay``: this machine's kernel is built
without ``sch_netem`` (``CONFIG_NET_SCH_NETEM`` is not set; ``tc`` answers "Specified qdisc
kind is unknown"), so the network-fault tests delay packets with netfilter's queue instead.

An ``iptables ... -j NFQUEUE --queue-num N`` rule hands each matching packet to this
process (``nfnetlink_queue``, metadata only: the kernel keeps the packet); it gives the
kernel its verdict (accept) ``delay`` milliseconds after the packet arrived, so every packet
on that path is held for ``delay`` ms, in order, like netem's constant delay. Run it inside
the network namespace whose rule it serves::

    ip netns exec NS python -m tests.integration._netem --queue 0 --delay-ms 50

It prints ``ready`` once bound, and runs until SIGTERM. Pure Python (the netlink messages
are packed here): nothing to install but ``iptables``.
"""

from __future__ import annotations

import argparse
import heapq
import select
import signal
import socket
import struct
import sys
import time
from types import FrameType

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET, NFQNL_MSG_VERDICT, NFQNL_MSG_CONFIG = 0, 1, 2
NFQA_CFG_CMD, NFQA_CFG_PARAMS, NFQA_CFG_QUEUE_MAXLEN = 1, 2, 3
NFQA_PACKET_HDR, NFQA_VERDICT_HDR = 1, 2
NFQNL_CFG_CMD_BIND = 1
NFQNL_COPY_META = 1
NF_ACCEPT = 1
NLM_F_REQUEST, NLM_F_ACK = 1, 4
NLMSG_ERROR = 2
#: packets the kernel may hold for this queue (the default 1,024 overflows at 50 ms)
QUEUE_MAXLEN = 65536


def _nlmsg(kind: int, flags: int, payload: bytes) -> bytes:
    return struct.pack("=IHHII", 16 + len(payload), kind, flags, 0, 0) + payload


def _attr(kind: int, data: bytes) -> bytes:
    size = 4 + len(data)
    return struct.pack("=HH", size, kind) + data + b"\0" * (-size % 4)


def _nfgen(queue: int) -> bytes:
    return struct.pack("=BBH", socket.AF_UNSPEC, 0, socket.htons(queue))


def _config(sock: socket.socket, queue: int, attrs: bytes) -> None:
    """Send one config message and raise OSError if the kernel refuses it."""
    sock.send(_nlmsg(NFNL_SUBSYS_QUEUE << 8 | NFQNL_MSG_CONFIG, NLM_F_REQUEST | NLM_F_ACK,
                     _nfgen(queue) + attrs))
    reply = sock.recv(4096)
    _, kind, _, _, _ = struct.unpack_from("=IHHII", reply)
    if kind == NLMSG_ERROR:
        (errno,) = struct.unpack_from("=i", reply, 16)
        if errno:
            raise OSError(-errno, f"nfnetlink_queue config refused (queue {queue})")


def packet_ids(data: bytes) -> list[int]:
    """The packet ids of the NFQNL_MSG_PACKET messages in one netlink read."""
    ids: list[int] = []
    off = 0
    while off + 16 <= len(data):
        length, kind, _, _, _ = struct.unpack_from("=IHHII", data, off)
        if length < 16:
            break
        if kind == NFNL_SUBSYS_QUEUE << 8 | NFQNL_MSG_PACKET:
            pos, end = off + 20, off + length  # after nlmsghdr + nfgenmsg
            while pos + 4 <= end:
                size, attr = struct.unpack_from("=HH", data, pos)
                if size < 4:
                    break
                if attr & 0x7FFF == NFQA_PACKET_HDR:
                    ids.append(struct.unpack_from(">I", data, pos + 4)[0])
                pos += (size + 3) & ~3
        off += (length + 3) & ~3
    return ids


def serve(queue: int, delay_s: float) -> None:
    """Bind ``queue`` and accept every packet ``delay_s`` after it arrived, until SIGTERM."""
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    sock.bind((0, 0))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 20)
    _config(sock, queue, _attr(NFQA_CFG_CMD, struct.pack("=BBH", NFQNL_CFG_CMD_BIND, 0, 0)))
    _config(sock, queue, _attr(NFQA_CFG_PARAMS, struct.pack(">IB", 0, NFQNL_COPY_META) +
                               b"\0\0\0") +
            _attr(NFQA_CFG_QUEUE_MAXLEN, struct.pack(">I", QUEUE_MAXLEN)))
    stop = False

    def _stop(_sig: int, _frame: FrameType | None) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _stop)
    print("ready", flush=True)
    held: list[tuple[float, int]] = []
    verdict = NFNL_SUBSYS_QUEUE << 8 | NFQNL_MSG_VERDICT
    while not stop or held:  # at SIGTERM, what is held goes out at once
        if stop:
            delay_s = 0.0
            held = [(0.0, pid) for _, pid in held]
        wait = max(0.0, held[0][0] - time.monotonic()) if held else 0.5
        try:
            readable, _, _ = select.select([sock], [], [], wait)
        except InterruptedError:
            continue
        if readable:
            now = time.monotonic()
            for pid in packet_ids(sock.recv(1 << 20)):
                heapq.heappush(held, (now + delay_s, pid))
        now = time.monotonic()
        while held and held[0][0] <= now:
            _, pid = heapq.heappop(held)
            sock.send(_nlmsg(verdict, NLM_F_REQUEST, _nfgen(queue) + _attr(
                NFQA_VERDICT_HDR, struct.pack(">II", NF_ACCEPT, pid))))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--queue", type=int, default=0)
    parser.add_argument("--delay-ms", type=float, required=True)
    args = parser.parse_args(argv)
    serve(args.queue, args.delay_ms / 1000)
    return 0


if __name__ == "__main__":
    sys.exit(main())
