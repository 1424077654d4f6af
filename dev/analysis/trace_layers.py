#!/usr/bin/env python3
"""Per-layer timeline of a CUDA trace from `fp4moe profile --device cuda --trace`:
for each layer (one router-logits kernel to the next) the medians, in µs, of the
logits kernel, the selection's end after the logits' end, the routed gate/up and
down kernels and the shared expert's kernels (phase "shared" in the trace, or
on another stream than the logits'), all relative to the logits kernel's end.
    python3 dev/analysis/trace_layers.py TRACE.json [...]"""
import json, re, statistics as st, sys

# the expert kernels' template arguments, mangled (CUPTI) or demangled:
# fm_expert_wg_kernel<NMAT, MX, NMAX, D2> and fm_expert_kernel<NT, NMAT, ...>;
# down is NMAT 1 or D2 (the 128-row down runs as two 64-row "matrices")
_WG = re.compile(r'fm_expert_wg_kernel(?:ILi(\d+)ELb(\d)ELi(\d+)ELb(\d)E|<(\d+), *(\w+), *(\d+), *(\w+)>)')
_MMA = re.compile(r'fm_expert_kernel(?:ILi(\d+)ELi(\d+)E|<(\d+), *(\d+))')


def kind(name):
    """LG (router logits), SEL (selection and grouping), GU, DN or None."""
    if 'logits' in name: return 'LG'
    if 'route' in name: return 'SEL'
    if 'fm_splitk_gu' in name: return 'GU'
    if 'fm_splitk_down' in name: return 'DN'
    m = _WG.search(name)
    if m:
        g = [x for x in m.groups() if x is not None]
        nmat, d2 = g[0], g[3]
        return 'DN' if nmat == '1' or d2 in ('1', 'true') else 'GU'
    m = _MMA.search(name)
    if m:
        g = [x for x in m.groups() if x is not None]
        return 'DN' if g[1] == '1' else 'GU'
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
            args = e.get('args')
            side = e.get('tid') != main or (isinstance(args, dict) and args.get('phase') == 'shared')
            key = ('sh_' if side and k in ('GU', 'DN') else '') + k
            if key in seen: continue
            seen[key] = 1
            row[key + '_start'] = e['ts'] - t0
            row[key + '_end'] = e['ts'] + e['dur'] - t0
            row[key + '_dur'] = e['dur']
        yield row


COLS = ['period', 'LG', 'SEL_end', 'GU_start', 'GU_dur', 'GU_end', 'DN_dur', 'DN_end', 'sh_GU_start', 'sh_GU_end',
        'sh_DN_end']


def summary(path):
    """(number of layers, {column: median}) of one trace file; ValueError
    naming the problem when it is not a Chrome trace of kernel events."""
    try:
        with open(path) as fh:
            d = json.load(fh)
    except (OSError, ValueError) as e:
        raise ValueError('%s: not a readable JSON trace (%s)' % (path, e))
    ev = d.get('traceEvents') if isinstance(d, dict) else d
    if not isinstance(ev, list):
        raise ValueError('%s: no traceEvents list' % path)
    try:
        # layers that ran the routed experts (a profile also times routing alone)
        rows = [r for r in layers([e for e in ev if isinstance(e, dict)]) if 'GU_end' in r and 'DN_end' in r]
    except (KeyError, TypeError) as e:
        raise ValueError('%s: a kernel event without a numeric ts, dur or name (%s)' % (path, e))
    med = {c: st.median([r[c] for r in rows if c in r]) for c in COLS if any(c in r for r in rows)}
    return len(rows), med


def main():
    if len(sys.argv) < 2:
        print('usage: trace_layers.py TRACE.json [...]', file=sys.stderr)
        return 2
    print('%-34s %5s ' % ('trace', 'n') + ' '.join('%10s' % c for c in COLS))
    for f in sys.argv[1:]:
        try:
            n, med = summary(f)
        except ValueError as e:
            print('trace_layers: %s' % e, file=sys.stderr)
            return 2
        print('%-34s %5d ' % (f[-34:], n) + ' '.join('%10.2f' % med.get(c, float('nan')) for c in COLS))
    return 0


if __name__ == '__main__':
    sys.exit(main())
