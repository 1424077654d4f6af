/* fp4moe trace summary|diff: parsing and printing; the analysis is src/trace. */
#include "cli.h"
#include "util/util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void usage(FILE *f) {
    fprintf(f,
            "usage: fp4moe trace summary FILE... [options]\n"
            "       fp4moe trace diff A B [options]\n"
            "\n"
            "Analyzes PyTorch-profiler (Kineto) Chrome traces, as SGLang and vLLM write them:\n"
            "JSON, plain or gzip (detected), one file per rank. Files named ...-TP-{r}... are\n"
            "grouped by rank r; summary prints each rank, then all ranks combined.\n"
            "\n"
            "  summary   per step: wall, GPU busy and idle time, communication time and how much\n"
            "            of it overlaps compute; per category: ms/step (mean, sd, min, max), events\n"
            "            per step and the duration distribution (mean, p50, p90, p99, max; HEAVY\n"
            "            marks a tail: mean >= 2 x median); the top kernels; the uncategorized ones.\n"
            "  diff      per category ms/step in A and B, the delta, each category's share of the\n"
            "            total delta, and the per-kernel deltas that explain it.\n"
            "\n"
            "options:\n"
            "  --steps auto|profiler|sglang|marker:REGEX\n"
            "            auto (default): ProfilerStep#N annotations, else SGLang step[DECODE bs=N]\n"
            "            spans, else one step covering the whole trace. marker:REGEX: every kernel\n"
            "            whose name matches REGEX (POSIX extended) starts a step.\n"
            "  --rules FILE  JSON array of {\"regex\": ..., \"category\": ...}, tried in order before\n"
            "            the built-in rules (case-insensitive POSIX extended regexes).\n"
            "  --format text|csv|json|html   (default text)\n"
            "            csv summary: name,category,count,total_us,mean_us,p50_us,p90_us,p99_us,max_us\n"
            "            (one row per kernel name, count and total over the whole trace);\n"
            "            csv diff: category,a_ms_per_step,b_ms_per_step,delta_ms,share_of_delta\n"
            "            (one row per category plus a total row).\n"
            "  --top N   kernels listed in text and HTML output (default 25)\n"
            "  --jobs N  files parsed in parallel (default: one per core)\n"
            "  -o FILE   write to FILE (atomically) instead of standard output\n"
            "\n"
            "Built-in categories: attention, moe_gemm, comm, moe_quant, moe_routing, moe_act,\n"
            "gemm (dense), memory (copies and sets), glue (norms, rotary, elementwise), other.\n"
            "Malformed input fails with the file and byte offset; nothing is printed then.\n"
            "See docs/trace.md.\n");
}

static int parse_format(const char *s, fm_trace_format *f) {
    if (!strcmp(s, "text")) *f = FM_TRACE_TEXT;
    else if (!strcmp(s, "csv")) *f = FM_TRACE_CSV;
    else if (!strcmp(s, "json")) *f = FM_TRACE_JSON;
    else if (!strcmp(s, "html")) *f = FM_TRACE_HTML;
    else return -1;
    return 0;
}

int fm_cmd_trace(int argc, char **argv) {
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
        usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    const char *sub = argv[1];
    int is_diff = !strcmp(sub, "diff");
    if (!is_diff && strcmp(sub, "summary")) {
        fprintf(stderr, "fp4moe trace: unknown subcommand '%s' (summary or diff)\n", sub);
        return 2;
    }
    fm_trace_options o;
    memset(&o, 0, sizeof o);
    fm_trace_format fmt = FM_TRACE_TEXT;
    const char *out_path = NULL;
    const char **files = calloc((size_t)argc, sizeof *files);
    if (!files) return fm_cli_fail("trace", fm_error(FM_E_NOMEM, "out of memory"));
    int nf = 0, rc = 2;
    for (int i = 2; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            rc = 0;
            goto done;
        } else if (!strcmp(a, "--steps") || !strcmp(a, "--rules") || !strcmp(a, "--format") || !strcmp(a, "--top") ||
                   !strcmp(a, "--jobs") || !strcmp(a, "-o")) {
            if (!v) {
                fprintf(stderr, "fp4moe trace: %s needs a value\n", a);
                goto done;
            }
            i++;
            if (!strcmp(a, "--steps")) {
                if (!strcmp(v, "auto")) o.steps = FM_TRACE_STEPS_AUTO;
                else if (!strcmp(v, "profiler")) o.steps = FM_TRACE_STEPS_PROFILER;
                else if (!strcmp(v, "sglang")) o.steps = FM_TRACE_STEPS_SGLANG;
                else if (!strncmp(v, "marker:", 7) && v[7]) {
                    o.steps = FM_TRACE_STEPS_MARKER;
                    o.marker = v + 7;
                } else {
                    fprintf(stderr, "fp4moe trace: --steps expects auto, profiler, sglang or marker:REGEX, got '%s'\n", v);
                    goto done;
                }
            } else if (!strcmp(a, "--rules")) {
                o.rules_path = v;
            } else if (!strcmp(a, "--format")) {
                if (parse_format(v, &fmt)) {
                    fprintf(stderr, "fp4moe trace: --format expects text, csv, json or html, got '%s'\n", v);
                    goto done;
                }
            } else if (!strcmp(a, "--top")) {
                long x;
                if (fm_cli_parse_int("trace", a, v, 1, 100000, &x)) goto done;
                o.top = (int)x;
            } else if (!strcmp(a, "--jobs")) {
                long x;
                if (fm_cli_parse_int("trace", a, v, 1, 64, &x)) goto done;
                o.jobs = (int)x;
            } else {
                out_path = v;
            }
        } else if (a[0] == '-' && a[1]) {
            fprintf(stderr, "fp4moe trace: unknown option '%s' (see fp4moe trace --help)\n", a);
            goto done;
        } else {
            files[nf++] = a;
        }
    }
    if (nf == 0 || (is_diff && nf != 2)) {
        fprintf(stderr, is_diff ? "fp4moe trace diff: expects exactly two trace files, A and B\n"
                                : "fp4moe trace summary: no trace files given\n");
        goto done;
    }
    /* The whole output is rendered into memory and printed only once the
     * analysis succeeded: a failure never leaves a partial table. */
    char *buf = NULL;
    size_t len = 0;
    FILE *mem = open_memstream(&buf, &len);
    if (!mem) {
        rc = fm_cli_fail("trace", fm_error(FM_E_NOMEM, "out of memory"));
        goto done;
    }
    fm_status s;
    if (is_diff) {
        fm_trace *a = NULL, *b = NULL;
        s = fm_trace_open(files, 1, &o, &a);
        if (s == FM_OK) s = fm_trace_open(files + 1, 1, &o, &b);
        if (s == FM_OK) s = fm_trace_write_diff(a, b, fmt, mem);
        fm_trace_free(a);
        fm_trace_free(b);
    } else {
        fm_trace *t = NULL;
        s = fm_trace_open(files, nf, &o, &t);
        if (s == FM_OK) s = fm_trace_write_summary(t, fmt, mem);
        fm_trace_free(t);
    }
    if (fclose(mem) != 0 && s == FM_OK) s = fm_error(FM_E_NOMEM, "out of memory rendering the output");
    if (s != FM_OK) {
        free(buf);
        rc = fm_cli_fail("trace", s);
        goto done;
    }
    if (out_path) {
        s = fm_write_file_atomic(out_path, buf, len);
        free(buf);
        rc = s == FM_OK ? 0 : fm_cli_fail("trace", s);
        goto done;
    }
    rc = fwrite(buf, 1, len, stdout) == len && fflush(stdout) == 0 ? 0 : 1;
    free(buf);
done:
    free(files);
    return rc;
}
