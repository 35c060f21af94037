"""A packet capture on the lab bridge, in Python (no tcpdump), and the TCP payloads it saw.

Run as a script inside the lab's namespace (`ip netns exec LAB python capture.py OUT PORT...`):
an AF_PACKET socket on every interface there (the bridge and its veth ports; frames forwarded
between two hosts cross the ports, not the bridge's own device) keeps each IPv4 TCP/UDP frame
to or from one of PORTs that leaves through a port (PACKET_OUTGOING: each forwarded frame once,
as the receiving host gets it) and appends it to OUT. It prints "ready" once the socket is
open, and on SIGTERM/SIGINT, once it has read what the socket still holds (on a busy machine
the reader lags the wire by seconds; stopping at once lost a third of a model load's frames),
one JSON line: frames kept, IPv4 fragments seen (they carry no ports, so they are not kept),
and the kernel's packet and drop counts.

`flows(OUT)` reads the frames back: per TCP direction, the payload reassembled by sequence
number (retransmissions overwrite, holes stay zero); per UDP direction, bytes and packets. The
veth ports pass GSO frames of up to 64 KiB, so most of a transfer arrives in a few big frames.
"""

from __future__ import annotations

import json
import signal
import socket
import struct
import sys
import time
from pathlib import Path

ETH_P_ALL = 0x0003
PACKET_OUTGOING = 4
SOL_PACKET, PACKET_STATISTICS = 263, 6
SO_RCVBUFFORCE = 33
RECORD = struct.Struct("!dI")  # timestamp, frame length; the frame follows


def _ports(frame: bytes):
    """(protocol, ip header start, ip header length, source port, destination port) of an
    IPv4 TCP/UDP Ethernet frame, else None."""
    if len(frame) < 34 or frame[12:14] != b"\x08\x00":
        return None
    ihl = (frame[14] & 0x0F) * 4
    proto = frame[23]
    if proto not in (6, 17) or len(frame) < 14 + ihl + 4:
        return None
    sport, dport = struct.unpack_from("!HH", frame, 14 + ihl)
    return proto, ihl, sport, dport


def capture(out: Path, ports: set[int]) -> dict:
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.append(time.monotonic()))
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 256 << 20)
    except OSError:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 20)
    sock.settimeout(0.2)
    kept = fragments = 0
    with open(out, "wb") as f:
        print("ready", flush=True)
        while not (stop and time.monotonic() - stop[0] > 60):
            try:
                frame, addr = sock.recvfrom(1 << 18)
            except (socket.timeout, InterruptedError):
                if stop:
                    break  # stopped, and nothing queued for 0.2 s: the buffer is drained
                continue
            if addr[2] != PACKET_OUTGOING:
                continue
            if len(frame) > 20 and frame[12:14] == b"\x08\x00" and \
                    struct.unpack_from("!H", frame, 20)[0] & 0x3FFF:
                fragments += 1  # IPv4 more-fragments or an offset: no ports to match
            head = _ports(frame)
            if head is None or not ({head[2], head[3]} & ports):
                continue
            f.write(RECORD.pack(time.time(), len(frame)) + frame)
            kept += 1
    packets, drops = struct.unpack("II", sock.getsockopt(SOL_PACKET, PACKET_STATISTICS, 8))
    return {"kept": kept, "fragments": fragments, "packets": packets, "drops": drops}


def frames(path: Path):
    """(timestamp, frame) of each record in a capture file."""
    data = Path(path).read_bytes()
    pos = 0
    while pos + RECORD.size <= len(data):
        ts, n = RECORD.unpack_from(data, pos)
        pos += RECORD.size
        yield ts, data[pos:pos + n]
        pos += n


def _address(frame: bytes, at: int) -> str:
    return socket.inet_ntoa(frame[at:at + 4])


def flows(path: Path) -> dict:
    """{("tcp"|"udp", src, sport, dst, dport): ...}: TCP -> reassembled payload (bytes),
    UDP -> {"bytes": payload bytes, "packets": n}."""
    tcp: dict = {}
    out: dict = {}
    for _, frame in frames(path):
        head = _ports(frame)
        if head is None:
            continue
        proto, ihl, sport, dport = head
        total = struct.unpack_from("!H", frame, 16)[0] or len(frame) - 14
        end = min(14 + total, len(frame))
        key = ("tcp" if proto == 6 else "udp", _address(frame, 26), sport,
               _address(frame, 30), dport)
        if proto == 17:
            entry = out.setdefault(key, {"bytes": 0, "packets": 0})
            entry["bytes"] += max(end - (14 + ihl + 8), 0)
            entry["packets"] += 1
            continue
        seq = struct.unpack_from("!I", frame, 14 + ihl + 4)[0]
        start = 14 + ihl + (frame[14 + ihl + 12] >> 4) * 4
        if end > start:
            tcp.setdefault(key, []).append((seq, frame[start:end]))
    for key, segments in tcp.items():
        out[key] = reassemble(segments)
    return out


def opened(path: Path) -> set[tuple[str, int, str, int]]:
    """(client, client port, server, server port) of each TCP connection whose opening SYN
    (SYN without ACK) the capture holds: a connection made while it ran, not one older than the
    capture whose segments (a retransmission, say) merely crossed it."""
    out = set()
    for _, frame in frames(path):
        head = _ports(frame)
        if head is None or head[0] != 6:
            continue
        flags = frame[14 + head[1] + 13]
        if flags & 0x12 == 0x02:
            out.add((_address(frame, 26), head[2], _address(frame, 30), head[3]))
    return out


def reassemble(segments: list[tuple[int, bytes]]) -> bytes:
    """One direction's payload from (sequence number, payload) pairs in capture order: placed
    at their offset from the first segment's number (mod 2**32), so reordering and
    retransmissions land where they belong; a missed segment leaves zeros."""
    base = segments[0][0]
    placed = []
    for seq, payload in segments:
        offset = (seq - base) & 0xFFFFFFFF
        if offset >= 1 << 31:
            offset -= 1 << 32  # before the first captured segment
        placed.append((offset, payload))
    low = min(o for o, _ in placed)
    buf = bytearray(max(o + len(p) for o, p in placed) - low)
    for offset, payload in placed:
        buf[offset - low:offset - low + len(payload)] = payload
    return bytes(buf)


if __name__ == "__main__":
    summary = capture(Path(sys.argv[1]), {int(p) for p in sys.argv[2:]})
    print(json.dumps(summary), flush=True)
