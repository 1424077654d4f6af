/* libFuzzer target: the streaming trace reader and the analysis behind
 * `fp4moe trace summary`, on one in-memory document. The same bytes are
 * also fed in small chunks (size from the first byte), so that every token
 * kind gets split across buffer refills. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fp4moe.h"
/* The trace sources are compiled into this target (the linker then takes
 * them from here, not from libfp4moe.a) so that they carry the fuzzer's
 * coverage and AddressSanitizer instrumentation, which the library build
 * does not add. */
#include "trace/trace_json.c"
#include "trace/trace_events.c"
#include "trace/trace_rules.c"
#include "trace/trace_analyze.c"
#include "trace/trace_output.c"

typedef struct {
    const uint8_t *p;
    size_t n, off, chunk;
} chunks;

static fm_status chunk_read(void *ctx, uint8_t *dst, size_t cap, size_t *got) {
    chunks *c = ctx;
    size_t k = c->n - c->off;
    if (k > c->chunk) k = c->chunk;
    if (k > cap) k = cap;
    memcpy(dst, c->p + c->off, k);
    c->off += k;
    *got = k;
    return FM_OK;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fm_trace *t = NULL;
    fm_trace_options o;
    memset(&o, 0, sizeof o);
    o.jobs = 1;
    if (fm_trace_open_mem(data, size, &o, &t) == FM_OK) {
        char *buf = NULL;
        size_t len = 0;
        FILE *m = open_memstream(&buf, &len);
        if (m) {
            fm_trace_write_summary(t, FM_TRACE_TEXT, m);
            fm_trace_write_summary(t, FM_TRACE_CSV, m);
            fm_trace_write_summary(t, FM_TRACE_JSON, m);
            fm_trace_write_summary(t, FM_TRACE_HTML, m);
            fm_trace_write_diff(t, t, FM_TRACE_TEXT, m);
            fclose(m);
        }
        free(buf);
        fm_trace_free(t);
    }
    chunks c = {data, size, 0, size ? 1 + data[0] % 13 : 1};
    fm_tr_file f;
    fm_tr_parse(chunk_read, &c, "fuzz", &f);
    fm_tr_file_free(&f);
    return 0;
}
