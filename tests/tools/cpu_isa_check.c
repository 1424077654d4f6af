/*
 * cpu_isa_check: the fast CPU engine against the float64 reference for every
 * kernel flavour this processor supports (portable C, AVX2, AVX-512), on
 * every tiny preset and format. Exits 1 on any mismatch, 0 when all pass.
 * Run it on any machine whose ISA the test machine lacks:
 *     build/tests/tools/cpu_isa_check [-v]
 */
#include <stdio.h>
#include <string.h>

#include "cpu_check.h"

int main(int argc, char **argv) {
    int verbose = argc > 1 && !strcmp(argv[1], "-v");
    static const fm_cpu_isa isas[] = {FM_CPU_SCALAR, FM_CPU_AVX2, FM_CPU_AVX512};
    int fails = 0, ran = 0;
    printf("best ISA of this CPU: %s\n", fm_cpu_isa_name(fm_cpu_isa_detect()));
    for (size_t i = 0; i < sizeof isas / sizeof *isas; i++) {
        for (int threads = 1; threads <= 3; threads += 2) {
            fm_cpu_engine *e = NULL;
            if (fm_cpu_engine_new(isas[i], threads, &e)) {
                printf("SKIPPED %s: %s\n", fm_cpu_isa_name(isas[i]), fm_last_error());
                break;
            }
            double worst = 0;
            int f = cpu_check_all(e, &worst, verbose, 0);
            printf("%-6s %d thread%s: %s (worst relative error %.3g)\n", fm_cpu_isa_name(isas[i]), threads,
                   threads == 1 ? " " : "s", f ? "FAIL" : "ok", worst);
            fails += f;
            ran++;
            fm_cpu_engine_free(e);
        }
    }
    if (!ran) {
        printf("no engine could be created\n");
        return 1;
    }
    return fails ? 1 : 0;
}
