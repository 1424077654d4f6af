#!/usr/bin/env python3
"""Is there a shorter FP4 -> BF16 decode than the wgmma kernels' 8 integer
instructions per word? An exhaustive search over the bit layouts the upload
may choose.

    python3 dev/analysis/fp4_decode_bound.py

The expert kernels turn one 32-bit word of 8 E2M1 codes into 4 registers of
two BF16 each (decode8 in src/cuda/expert.cu). A BF16 holds an E2M1 value,
times a power of two that the block scale's multiply absorbs, exactly when
the code's sign sits at bit 15 and its two exponent bits and mantissa bit at
bits 8, 7, 6: so each output register is the word's bits moved to the
positions M = {6, 7, 8, 15, 22, 23, 24, 31} and everything else zero. The
upload stores each word's 32 bits in any order it likes (fm_fp4_enc_word),
so the question is only which single-instruction moves, followed by the
`& M` of one LOP3, can cover all 32 bits with 4 (or, across two words, 8)
disjoint outputs. The forms searched, each costing its instruction count:

  w & M                              1 (LOP3)
  funnel(wi, wj, s) & M              2 (SHF + LOP3): any 32-bit window of
                                       a word pair (a rotate when i == j)
  prmt(wi, wj, sel) & M              2 (PRMT + LOP3): any 4 of the pair's 8
                                       bytes, each in any byte position

What the kernels run is 1 + 2 + 2 + 3 = 8 per word: w & M, two rotates, and
((w & K) * C) & M for the last 8 bits (LOP3, IMAD, LOP3). The search finds
no cover at all with 2-instruction forms alone, for one word or for a pair
of words (so no 7-instruction word, and no 15-instruction pair), which makes
8 per word the least among these forms. The 4 HMUL2 that apply the block
scale are a separate, fixed cost (one per register).
"""
import itertools
import sys

M = (6, 7, 8, 15, 22, 23, 24, 31)
MSET = frozenset(M)


def candidates(nw):
    """(bits of the nw-word group an output takes, description) for every
    2-instruction form."""
    n = 32 * nw
    out = {}
    for i in range(nw):
        for j in range(nw):
            for s in range(32):
                # funnel(wi, wj, s): window bits s .. s + 31 of wj:wi
                bits = []
                for p in M:
                    q = s + p
                    bits.append(i * 32 + q if q < 32 else j * 32 + q - 32)
                key = frozenset(bits)
                if len(key) == 8:
                    out.setdefault(key, f"funnel(w{i}, w{j}, {s})")
            # prmt(wi, wj, sel): output byte k takes source byte b of wi:wj;
            # M keeps bits {6, 7} of bytes 0 and 2 and bits {0, 7} of 1 and 3
            keep = ((6, 7), (0, 7), (6, 7), (0, 7))
            for sel in itertools.product(range(8), repeat=4):
                bits = []
                for k, b in enumerate(sel):
                    base = (i if b < 4 else j) * 32 + (b % 4) * 8
                    bits += [base + o for o in keep[k]]
                key = frozenset(bits)
                if len(key) == 8:
                    out.setdefault(key, f"prmt(w{i}, w{j}, {sel})")
    assert all(max(k) < n for k in out)
    return list(out.items())


def cover(nw, plain):
    """An exact cover of the group's bits by `w & M` of the words in
    `plain` and 2-instruction forms, or None."""
    n = 32 * nw
    used = frozenset()
    for w in plain:
        used |= frozenset(w * 32 + p for p in M)
    by_bit = {}
    for bits, what in candidates(nw):
        if bits & used:
            continue
        for b in bits:
            by_bit.setdefault(b, []).append((bits, what))
    chosen = []

    def rec(used):
        if len(used) == n:
            return True
        b = min(set(range(n)) - used)
        for bits, what in by_bit.get(b, []):
            if bits & used:
                continue
            chosen.append(what)
            if rec(used | bits):
                return True
            chosen.pop()
        return False

    return list(chosen) if rec(used) else None


def main():
    cases = [
        (1, (), "one word, four 2-instruction outputs (8)"),
        (1, (0,), "one word, w & M and three 2-instruction outputs (7)"),
        (2, (0,), "two words, one w & M and seven 2-instruction outputs (15)"),
        (2, (0, 1), "two words, two w & M and six 2-instruction outputs (14)"),
    ]
    found_short = False
    for nw, plain, what in cases:
        c = cover(nw, plain)
        print(f"{what}: {'cover found: ' + ', '.join(c) if c else 'no cover'}")
        cost = len(plain) + 2 * (4 * nw - len(plain))
        if c and cost < 8 * nw:
            found_short = True
    print("shorter than 8 integer instructions per word:", "yes" if found_short else "no")
    return 1 if found_short else 0


if __name__ == "__main__":
    sys.exit(main())
