"""rpc-server's HELLO as Python source a host runs: `status` asks each worker whether it
answers and with which protocol, `bench --sweep` times the round trip. Values reach the
script as arguments (sys.argv), never in its text."""

# recv(s, n): exactly n bytes or EOFError; hello(s): sends HELLO (command 14 with its 24-byte
# body, as llama-server sends it first) and returns the reply's payload (major, minor, patch).
# The reply's length is the listener's to choose: one above REPLY_MAX is an EOFError (no HELLO
# reply), never a read of that many bytes.
FUNCTIONS = r"""
import socket, struct, sys, time
def recv(s, n):
    b = b""
    while len(b) < n:
        c = s.recv(n - len(b))
        if not c:
            raise EOFError
        b += c
    return b
REPLY_MAX = 64
def hello(s):
    s.sendall(bytes([14]) + struct.pack("<Q", 24) + bytes(24))
    size = struct.unpack("<Q", recv(s, 8))[0]
    if size > REPLY_MAX:
        raise EOFError("a HELLO reply of %d bytes" % size)
    return recv(s, size)
"""
