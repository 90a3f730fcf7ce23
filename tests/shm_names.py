"""Names of the CPU backend's shared-memory segments, recomputed in Python so tests can play
the squatter (cpp/kernels/cpu/channel.cc, SegmentName, is the product's definition).

    /fluxjax-<session>-<SipHash-2-4(secret, 0, ...)><SipHash-2-4(secret, 1, ...)>

over the little-endian int64 words (half, reset generation, call site, group index, group
size, then the group's global device ids in rank order). `legacy_name` is the name the channel
used before it took a secret: predictable from the job token (visible in /dev/shm) and a
call-site counter.
"""

import struct

_M = (1 << 64) - 1


def _rotl(x, b):
    return ((x << b) | (x >> (64 - b))) & _M


def siphash24(key: bytes, msg: bytes) -> int:
    """SipHash-2-4 with a 16-byte key, 64-bit output (Aumasson and Bernstein's reference)."""
    k0, k1 = struct.unpack("<QQ", key)
    v = [k0 ^ 0x736F6D6570736575, k1 ^ 0x646F72616E646F6D, k0 ^ 0x6C7967656E657261, k1 ^ 0x7465646279746573]

    def rounds(n):
        for _ in range(n):
            v[0] = (v[0] + v[1]) & _M
            v[1] = _rotl(v[1], 13) ^ v[0]
            v[0] = _rotl(v[0], 32)
            v[2] = (v[2] + v[3]) & _M
            v[3] = _rotl(v[3], 16) ^ v[2]
            v[0] = (v[0] + v[3]) & _M
            v[3] = _rotl(v[3], 21) ^ v[0]
            v[2] = (v[2] + v[1]) & _M
            v[1] = _rotl(v[1], 17) ^ v[2]
            v[2] = _rotl(v[2], 32)

    tail = len(msg) - len(msg) % 8
    for i in range(0, tail, 8):
        m = int.from_bytes(msg[i : i + 8], "little")
        v[3] ^= m
        rounds(2)
        v[0] ^= m
    b = ((len(msg) & 0xFF) << 56) | int.from_bytes(msg[tail:], "little")
    v[3] ^= b
    rounds(2)
    v[0] ^= b
    v[2] ^= 0xFF
    rounds(4)
    return v[0] ^ v[1] ^ v[2] ^ v[3]


def segment_name(
    session: str, secret_hex: str, callsite: int, group_index: int, devices: list[int], generation: int = 0
) -> str:
    key = bytes.fromhex(secret_hex)
    words = (generation, callsite, group_index, len(devices), *devices)
    halves = [siphash24(key, struct.pack(f"<{1 + len(words)}q", half, *words)) for half in (0, 1)]
    return f"/fluxjax-{session}-{halves[0]:016x}{halves[1]:016x}"


def legacy_name(session: str, callsite: int, devices) -> str:
    h = 1469598103934665603  # FNV-1a over 64-bit words of the group's device ids
    for d in devices:
        h = ((h ^ (d & _M)) * 1099511628211) & _M
    return f"/fluxjax-{session}-{callsite}-{h:016x}"
