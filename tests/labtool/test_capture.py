"""tests/support/capture.py's reading side: frames as the lab capture writes them, reassembled."""

from __future__ import annotations

import os
import socket
import struct

from support import capture


def frame(src: str, dst: str, sport: int, dport: int, payload: bytes, seq: int = 0,
          udp: bool = False, flags: int = 0x18) -> bytes:
    l4 = (struct.pack("!HHHH", sport, dport, 8 + len(payload), 0) if udp else
          struct.pack("!HHIIBBHHH", sport, dport, seq, 0, 5 << 4, flags, 65535, 0, 0))
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(l4) + len(payload), 0, 0, 64,
                     17 if udp else 6, 0, socket.inet_aton(src), socket.inet_aton(dst))
    return b"\x02" * 12 + b"\x08\x00" + ip + l4 + payload


def write(path, frames):
    with open(path, "wb") as f:
        for fr in frames:
            f.write(capture.RECORD.pack(0.0, len(fr)) + fr)


def test_a_window_across_segments_out_of_order_and_retransmitted_is_found(tmp_path):
    stream = os.urandom(5000)
    seq = 0xFFFFF000  # the sequence numbers wrap inside the stream
    cuts = [(0, 1400), (2800, 4200), (1400, 2800), (1400, 2800), (4200, 5000)]
    frames = [frame("10.200.0.11", "10.200.0.12", 40000, 50052, stream[a:b],
                    (seq + a) & 0xFFFFFFFF) for a, b in cuts]
    frames.append(frame("10.200.0.12", "10.200.0.11", 50052, 40000, b"ok", 7))
    frames.append(frame("10.200.0.11", "10.200.0.12", 51820, 51820, b"x" * 148, udp=True))
    frames.append(b"\x02" * 12 + b"\x86\xdd" + b"\x00" * 60)  # IPv6: ignored
    write(tmp_path / "cap", frames)
    flows = capture.flows(tmp_path / "cap")
    assert flows[("tcp", "10.200.0.11", 40000, "10.200.0.12", 50052)] == stream
    assert stream[1370:1434] in flows[("tcp", "10.200.0.11", 40000, "10.200.0.12", 50052)]
    assert flows[("tcp", "10.200.0.12", 50052, "10.200.0.11", 40000)] == b"ok"
    assert flows[("udp", "10.200.0.11", 51820, "10.200.0.12", 51820)] == {"bytes": 148,
                                                                          "packets": 1}


def test_a_missed_segment_leaves_a_hole_not_a_splice(tmp_path):
    stream = os.urandom(3000)
    write(tmp_path / "cap", [frame("1.1.1.1", "2.2.2.2", 1, 2, stream[a:b], 100 + a)
                             for a, b in ((0, 1000), (2000, 3000))])
    got = capture.flows(tmp_path / "cap")[("tcp", "1.1.1.1", 1, "2.2.2.2", 2)]
    assert got == stream[:1000] + bytes(1000) + stream[2000:]


def test_only_connections_opened_during_the_capture_count_as_opened(tmp_path):
    """A SYN marks a connection made while the capture ran; its SYN-ACK does not mark the
    server as a client; a retransmitted segment of an older connection marks nothing."""
    write(tmp_path / "cap", [
        frame("10.200.0.11", "10.200.0.12", 40000, 50052, b"", 1, flags=0x02),
        frame("10.200.0.12", "10.200.0.11", 50052, 40000, b"", 9, flags=0x12),
        frame("10.200.0.11", "10.200.0.12", 46276, 50052, b"\x0b" + bytes(12), 5)])
    assert capture.opened(tmp_path / "cap") == {("10.200.0.11", 40000, "10.200.0.12", 50052)}
    assert ("tcp", "10.200.0.11", 46276, "10.200.0.12", 50052) in capture.flows(tmp_path / "cap")
