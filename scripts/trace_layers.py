#!/usr/bin/env python3
"""Per-layer timeline of a CUDA trace from `fp4moe profile --device cuda --trace`:
for each layer (one router-logits kernel to the next) the medians, in µs, of the
logits kernel, the selection's end after the logits' end, the routed gate/up and
down kernels (on the logits' stream) and the shared expert's kernels (on the
other stream), all relative to the logits kernel's end.
    python3 scripts/trace_layers.py TRACE.json [...]"""
import json, statistics as st, sys


def kind(name):
    if 'logits' in name: return 'LG'
    if 'route' in name: return 'SEL'
    if 'expert' in name: return 'DN' if ('ELb1EE' in name or 'ILi1E' in name) else 'GU'
    return None


def layers(ev):
    ks = sorted((e for e in ev if e.get('ph') == 'X' and e.get('cat') == 'kernel'), key=lambda e: e['ts'])
    lgs = [i for i, e in enumerate(ks) if kind(e['name']) == 'LG']
    for a, b in zip(lgs, lgs[1:]):
        lg = ks[a]
        t0 = lg['ts'] + lg['dur']
        row = {'LG': lg['dur'], 'period': ks[b]['ts'] - lg['ts']}
        main = lg.get('tid')
        seen = {}
        for e in ks[a + 1:b]:
            k = kind(e['name'])
            if not k: continue
            side = e.get('tid') != main
            key = ('sh_' if side and k in ('GU', 'DN') else '') + k
            if key in seen: continue
            seen[key] = 1
            row[key + '_start'] = e['ts'] - t0
            row[key + '_end'] = e['ts'] + e['dur'] - t0
            row[key + '_dur'] = e['dur']
        yield row


def main():
    cols = ['period', 'LG', 'SEL_end', 'GU_start', 'GU_dur', 'GU_end', 'DN_dur', 'DN_end', 'sh_GU_start', 'sh_GU_end',
            'sh_DN_end']
    print('%-34s %5s ' % ('trace', 'n') + ' '.join('%10s' % c for c in cols))
    for f in sys.argv[1:]:
        d = json.load(open(f))
        ev = d['traceEvents'] if isinstance(d, dict) else d
        # layers that ran the routed experts (a profile also times routing alone)
        rows = [r for r in layers(ev) if 'GU_end' in r and 'DN_end' in r]
        med = lambda c: st.median([r[c] for r in rows if c in r]) if any(c in r for r in rows) else float('nan')
        print('%-34s %5d ' % (f[-34:], len(rows)) + ' '.join('%10.2f' % med(c) for c in cols))


if __name__ == '__main__':
    main()
