#!/usr/bin/env python3
"""The routing's timeline from the stamps that dev/gpu/patches/route-stamps.patch
prints: `fp4moe bench --device cuda ... > LOG` with a build of that patch, then

  python3 dev/analysis/route_stamps.py LOG [...]

STAMP lines (µs from the first logits block's start, %globaltimer): every
logits block past its wait (lgwait), the last logits block done (lgend; -1
where cuBLAS computes the logits: its kernels carry no stamps, and the origin
and lgwait are then the prep kernel's, which runs just before), the
first selection block started (selstart), the first and the last past their
wait (selwait0, selwait1), the last warp's top-k written (selected), the
grouping block elected (elect), the grouping done (grouped). GST lines (SM
cycles of the grouping block, clock64): its wait, its own tokens' selection,
the election, then the grouping's steps (zero, pass1, scans, act, pass2, end).
SST lines (SM cycles of the one-block selection, path 1, or of the last
block's one-warp grouping, path 2): the wait, the block's scores and the
first warp's top-k (one token), the selection, the block barrier or the
election, the grouping. EXP lines (µs from the previous layer's first logits
block's start): the routed gate/up's first block past its wait (guwait) and
last block done (guend), the routed down's first block past its wait (dnwait)
and last done (dnend), and this layer's logits past their wait (nextlg, the
layer's period). Where one token runs the one-launch kernel (fm_fused1_kernel)
the EXP fields are its blocks: the first past its wait on the routing
(guwait), the last with its h rows written (guend), the first past its waits
on h (dnwait), the last slice's output written (dnend); and FUS lines add the
last block past its wait on the routing (waitmax), the last warp's gate/up
sums done (gusums), the last block past its waits on h (hwaitmax), the last
routed block's down weights landed in its shared memory (dnland). FSEL
lines, where that launch selected the top-k itself (no selection kernel, so
no STAMP or EXP line; µs from this layer's first logits block): the first and
the last block with its expert known (routed0, routed), the last warp's
gate/up sums (gusums), the last block with its h rows written (hdone), the
first and the last past their waits on h (hwait0, hwait), the last routed
block's down weights landed (dnland), the last block's output added
(sumend), the grid's last block done (end), the first and the last block
started (entry0, entry) and past their wait on the logits (waited0, waited),
and the last with the scores computed (scored). LAYER lines, with FSEL, time
that layer whole from the previous layer's one-token launch's end (its last
block done): the same layer's logits blocks, the first and the last started
(lg_in0, lg_in), past their wait on the previous layer (lg_waited0,
lg_waited) and the last done (lg_done), then the launch's first and last block
started (fu_in0, fu_in), past their wait on the logits (fu_waited0,
fu_waited), with the scores (scored), the first and the last with its expert
(routed0, routed), the last warp's gate/up sums (gusums), h written (hdone),
the last past its waits on h (hwait), down's weights landed (dnland), the last
output added (sumend) and the launch's end (end, the layer's period).
Prints the median of every field per batch size; each field's median is taken
alone. Exit 2 with a message on a log without stamps or with a broken line.
"""
import statistics as st
import sys

STAMP = ('lgwait', 'lgend', 'selstart', 'selwait0', 'selwait1', 'selected', 'elect', 'grouped')
GST = ('wait', 'select', 'elect', 'zero', 'pass1', 'scans', 'act', 'pass2', 'end')
SST = ('path', 'wait', 'scores', 'pick', 'select', 'sync', 'group')
EXP = ('guwait', 'guend', 'dnwait', 'dnend', 'nextlg')
FUS = ('waitmax', 'gusums', 'hwaitmax', 'dnland')
FSEL = ('routed0', 'routed', 'gusums', 'hdone', 'hwait0', 'hwait', 'dnland', 'sumend', 'end', 'entry0', 'entry',
        'waited0', 'waited', 'scored')
LAYER = ('lg_in0', 'lg_in', 'lg_waited0', 'lg_waited', 'lg_done', 'fu_in0', 'fu_in', 'fu_waited0', 'fu_waited',
         'scored', 'routed0', 'routed', 'gusums', 'hdone', 'hwait', 'dnland', 'sumend', 'end')
KINDS = {'STAMP': (STAMP, 'us'), 'GST': (GST, 'cycles'), 'SST': (SST, 'cycles'), 'EXP': (EXP, 'us'),
         'FUS': (FUS, 'us'), 'FSEL': (FSEL, 'us'), 'LAYER': (LAYER, 'us')}


def parse(path):
    """{(kind, T): [ {field: value} ]} of the log at path, kind one of KINDS."""
    rows = {}
    with open(path, errors='replace') as f:
        for n, line in enumerate(f, 1):
            w = line.split()
            if not w or w[0] not in KINDS:
                continue
            kind = w[0]
            names = KINDS[kind][0]
            try:
                if not w[1].startswith('T='):
                    raise ValueError
                T = int(w[1][2:])
                rest = w[2:]
                if kind == 'STAMP':
                    if not rest or not rest[0].startswith('k='):
                        raise ValueError
                    rest = rest[1:]
                got = dict(zip(rest[0::2], rest[1::2]))
                if len(rest) != 2 * len(names) or set(got) != set(names) or T <= 0:
                    raise ValueError
                vals = {k: float(v) for k, v in got.items()}
            except ValueError:
                raise ValueError('%s:%d: not a %s line: %s' % (path, n, kind, line.strip()[:120]))
            rows.setdefault((kind, T), []).append(vals)
    if not rows:
        raise ValueError('%s: no STAMP, GST, SST, EXP, FUS, FSEL or LAYER lines (a bench log of a route-stamps build?)'
                         % path)
    return rows


def main():
    if len(sys.argv) < 2:
        print('usage: route_stamps.py LOG [...]', file=sys.stderr)
        return 2
    for path in sys.argv[1:]:
        try:
            rows = parse(path)
        except (OSError, ValueError) as e:
            print('route_stamps: %s' % e, file=sys.stderr)
            return 2
        print('== %s' % path)
        for kind, (names, unit) in KINDS.items():
            for T in sorted(t for k, t in rows if k == kind):
                r = rows[(kind, T)]
                med = ' '.join('%s %.2f' % (c, st.median(x[c] for x in r)) for c in names)
                print('%-5s T=%-4d n=%-3d %s: %s' % (kind, T, len(r), unit, med))
    return 0


if __name__ == '__main__':
    sys.exit(main())
