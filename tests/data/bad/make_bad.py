#!/usr/bin/env python3
"""Writes the malformed safetensors files of this folder (and the valid
references in ../st/). Standard library only; run it from anywhere:

    python3 tests/data/bad/make_bad.py

Each file breaks exactly one rule of the official reader; README lists them
with the error the library must report (tests/test_safetensors.c checks it).
"""
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
GOOD = os.path.join(HERE, "..", "st")


def st(header, data=b"", n=None):
    """A file: u64 header length (n overrides it), header bytes, data."""
    if isinstance(header, str):
        header = header.encode("utf-8")
    return struct.pack("<Q", len(header) if n is None else n) + header + data


def write(folder, name, blob):
    with open(os.path.join(folder, name), "wb") as f:
        f.write(blob)


F32x2 = '"dtype":"F32","shape":[2],"data_offsets":[0,8]'
bad = {
    "truncated.safetensors": b"\x10\x00\x00\x00\x00",
    "header_past_eof.safetensors": st('{"a":{' + F32x2 + '}}', n=1000),
    "header_too_large.safetensors": st("{}", n=200_000_000),
    "empty_header.safetensors": st(""),
    "not_brace.safetensors": st('  {"a":{' + F32x2 + '}}', bytes(8)),
    "bad_utf8.safetensors": st(b'{"a\xff":{' + F32x2.encode() + b'}}', bytes(8)),
    "overlong_utf8.safetensors": st(b'{"a\xc0\xaf":{' + F32x2.encode() + b'}}', bytes(8)),
    "lone_surrogate.safetensors": st('{"a\\ud800":{' + F32x2 + '}}', bytes(8)),
    "invalid_json.safetensors": st('{"a":{' + F32x2 + '}', bytes(8)),
    "nul_in_header.safetensors": st(b'{"a":{' + F32x2.encode() + b'}}\x00', bytes(8)),
    "duplicate_name.safetensors": st('{"a":{' + F32x2 + '},"a":{' + F32x2 + '}}', bytes(8)),
    "entry_not_object.safetensors": st('{"a":5}'),
    "missing_offsets.safetensors": st('{"a":{"dtype":"F32","shape":[2]}}', bytes(8)),
    "offsets_three.safetensors": st('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4,8]}}', bytes(8)),
    "end_before_begin.safetensors": st('{"a":{"dtype":"U8","shape":[0],"data_offsets":[0,0]},'
                                       '"b":{"dtype":"U8","shape":[4],"data_offsets":[8,4]}}', bytes(8)),
    "overlap.safetensors": st('{"a":{' + F32x2 + '},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}',
                              bytes(12)),
    "gap.safetensors": st('{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},'
                          '"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}}', bytes(12)),
    "not_from_zero.safetensors": st('{"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}', bytes(8)),
    "size_mismatch.safetensors": st('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}', bytes(4)),
    "shape_overflow.safetensors": st('{"a":{"dtype":"F32","shape":[4294967296,4294967296,2],'
                                     '"data_offsets":[0,0]}}'),
    "shape_overflow_zero.safetensors": st('{"a":{"dtype":"U8","shape":[4611686018427387904,8,0],'
                                          '"data_offsets":[0,0]}}'),
    "bytes_overflow.safetensors": st('{"a":{"dtype":"F64","shape":[4611686018427387904],'
                                     '"data_offsets":[0,0]}}'),
    "negative_shape.safetensors": st('{"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,0]}}'),
    "float_shape.safetensors": st('{"a":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}}', bytes(8)),
    "negative_offset.safetensors": st('{"a":{"dtype":"F32","shape":[0],"data_offsets":[-4,0]}}'),
    "too_many_dims.safetensors": st('{"a":{"dtype":"U8","shape":[1,1,1,1,1,1,1,1,1],"data_offsets":[0,1]}}',
                                    bytes(1)),
    "unknown_dtype.safetensors": st('{"a":{"dtype":"F33","shape":[2],"data_offsets":[0,8]}}', bytes(8)),
    "dtype_not_string.safetensors": st('{"a":{"dtype":7,"shape":[2],"data_offsets":[0,8]}}', bytes(8)),
    "f4_odd.safetensors": st('{"a":{"dtype":"F4","shape":[3],"data_offsets":[0,2]}}', bytes(2)),
    "data_not_at_end.safetensors": st('{"a":{' + F32x2 + '}}', bytes(12)),
    "data_short.safetensors": st('{"a":{' + F32x2 + '}}', bytes(4)),
    "metadata_not_string.safetensors": st('{"__metadata__":{"k":1},"a":{' + F32x2 + '}}', bytes(8)),
    "metadata_not_object.safetensors": st('{"__metadata__":"x","a":{' + F32x2 + '}}', bytes(8)),
}
for name, blob in bad.items():
    write(HERE, name, blob)

# Valid references: padding, scalar, zero-size tensors, F4, metadata.
os.makedirs(GOOD, exist_ok=True)
hdr = ('{"__metadata__":{"format":"pt","note":"h\\u00e9"},'
       '"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},'
       '"empty":{"dtype":"BF16","shape":[3,0],"data_offsets":[16,16]},'
       '"s":{"dtype":"I64","shape":[],"data_offsets":[16,24]},'
       '"q":{"dtype":"F4","shape":[2,3],"data_offsets":[24,27]}}')
hdr += " " * (-(len(hdr.encode()) + 8) % 8)
data = struct.pack("<4f", 1.0, -2.0, 0.5, 3.0) + struct.pack("<q", -7) + bytes([0x21, 0x43, 0x65])
write(GOOD, "small.safetensors", st(hdr, data))
write(GOOD, "empty.safetensors", st("{}"))
