/*
 * cpu_ab: two CPU kernel flavours on the same layers in one process, their
 * passes alternating, so that a shared machine's drift (the probe moves by
 * 10 - 20 % from one run to the next on the hosts we use) does not decide a
 * comparison the way separate `fp4moe bench` runs would:
 *
 *   cpu_ab [--preset NAME] [--isa A,B] [--threads N] [--batch 1,16]
 *          [--rounds R] [--time-ms MS] [--layers L] [--env-b NAME=VALUE]
 *
 * For each batch size, R rounds of fm_cpu_bench on engine A then engine B
 * (at least MS each); prints the median over rounds of each engine's
 * per-layer median, their ratio B / A, and the probe's bandwidth at the
 * start. --env-b sets an environment variable after engine A is made and
 * before engine B (for switches an engine reads when it is made). Exits 77
 * (skipped) when the CPU lacks one of the ISAs.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fp4moe.h"

static int parse_isa(const char *s, fm_cpu_isa *out) {
    static const char *names[] = {"scalar", "avx2", "avx512"};
    static const fm_cpu_isa isas[] = {FM_CPU_SCALAR, FM_CPU_AVX2, FM_CPU_AVX512};
    for (int i = 0; i < 3; i++)
        if (!strcmp(s, names[i])) {
            *out = isas[i];
            return 1;
        }
    return 0;
}

static int arg_long(const char *flag, const char *v, long lo, long hi, long *out) {
    char *end = NULL;
    long x = v ? strtol(v, &end, 10) : 0;
    if (!v || !*v || *end || x < lo || x > hi) {
        fprintf(stderr, "cpu_ab: %s needs an integer in [%ld, %ld]\n", flag, lo, hi);
        return 0;
    }
    *out = x;
    return 1;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

#define MAXB 16
#define MAXR 64

int main(int argc, char **argv) {
    const char *preset = "qwen3-30b-a3b", *env_b = NULL;
    char isa_arg[64] = "avx2,avx512", batch_arg[256] = "1,16";
    long threads = 0, rounds = 5, time_ms = 400, n_layers = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int ok = 1;
        if (!strcmp(a, "--preset") && v) preset = v;
        else if (!strcmp(a, "--isa") && v && strlen(v) < sizeof isa_arg) strcpy(isa_arg, v);
        else if (!strcmp(a, "--batch") && v && strlen(v) < sizeof batch_arg) strcpy(batch_arg, v);
        else if (!strcmp(a, "--threads")) ok = arg_long(a, v, 1, 1024, &threads);
        else if (!strcmp(a, "--rounds")) ok = arg_long(a, v, 1, MAXR, &rounds);
        else if (!strcmp(a, "--time-ms")) ok = arg_long(a, v, 1, 600000, &time_ms);
        else if (!strcmp(a, "--layers")) ok = arg_long(a, v, 1, 256, &n_layers);
        else if (!strcmp(a, "--env-b") && v && strchr(v, '=') && v[0] != '=') env_b = v;
        else {
            fprintf(stderr, "cpu_ab: unknown or incomplete argument '%s'\n", a);
            return 2;
        }
        if (!ok) return 2;
        i++;
    }
    fm_cpu_isa isa[2];
    char *comma = strchr(isa_arg, ',');
    if (!comma) {
        fprintf(stderr, "cpu_ab: --isa needs two flavours, A,B (scalar, avx2, avx512)\n");
        return 2;
    }
    *comma = 0;
    if (!parse_isa(isa_arg, &isa[0]) || !parse_isa(comma + 1, &isa[1])) {
        fprintf(stderr, "cpu_ab: --isa: unknown flavour in '%s,%s' (scalar, avx2, avx512)\n", isa_arg, comma + 1);
        return 2;
    }
    int batch[MAXB], nb = 0;
    for (char *tok = strtok(batch_arg, ","); tok; tok = strtok(NULL, ",")) {
        long b;
        if (nb == MAXB) {
            fprintf(stderr, "cpu_ab: --batch lists more than %d batch sizes\n", MAXB);
            return 2;
        }
        if (!arg_long("--batch", tok, 1, 4096, &b)) return 2;
        batch[nb++] = (int)b;
    }
    if (!nb) {
        fprintf(stderr, "cpu_ab: --batch is empty\n");
        return 2;
    }
    fm_model_desc d;
    if (fm_preset_desc(preset, FM_QF_NONE, &d)) {
        fprintf(stderr, "cpu_ab: %s\n", fm_last_error());
        return 2;
    }
    fm_cpu_engine *e[2] = {NULL, NULL};
    for (int i = 0; i < 2; i++) {
        if (i == 1 && env_b) {
            char name[128];
            const size_t n = (size_t)(strchr(env_b, '=') - env_b);
            if (n >= sizeof name) {
                fprintf(stderr, "cpu_ab: --env-b: variable name too long\n");
                fm_cpu_engine_free(e[0]);
                return 2;
            }
            memcpy(name, env_b, n);
            name[n] = 0;
            setenv(name, env_b + n + 1, 1);
        }
        if (fm_cpu_engine_new(isa[i], (int)threads, &e[i])) {
            printf("SKIPPED: %s\n", fm_last_error());
            fm_cpu_engine_free(e[0]);
            return 77;
        }
    }
    if (!n_layers) n_layers = fm_cpu_bench_default_layers(&d, d.expert_format);
    fm_moe_layer **layers = calloc((size_t)n_layers, sizeof *layers);
    int rc = 1;
    if (!layers) goto done;
    for (long i = 0, L = 0; i < n_layers; i++, L++) {
        while (L < d.n_layers && !fm_model_is_moe_layer(&d, (int)L)) L++;
        if (fm_moe_layer_random(&d, d.expert_format, 1, (int)(L % d.n_layers), &layers[i])) {
            fprintf(stderr, "cpu_ab: %s\n", fm_last_error());
            goto done;
        }
    }
    printf("preset %s, %ld layers, probe %.2f GB/s\n", preset, n_layers,
           fm_cpu_measure_bandwidth((size_t)512 << 20, (int)threads) / 1e9);
    printf("A: %s\nB: %s%s%s\n", fm_cpu_engine_describe(e[0]), fm_cpu_engine_describe(e[1]), env_b ? ", " : "",
           env_b ? env_b : "");
    printf("%6s %12s %12s %8s   (medians over %ld alternating rounds, us per layer)\n", "batch", "A", "B", "B/A",
           rounds);
    for (int bi = 0; bi < nb; bi++) {
        double us[2][MAXR];
        for (long r = 0; r < rounds; r++)
            for (int i = 0; i < 2; i++) {
                fm_cpu_bench_result res;
                if (fm_cpu_bench(e[i], &d, layers, (int)n_layers, batch[bi], 7, time_ms / 1000.0, NULL, NULL, &res)) {
                    fprintf(stderr, "cpu_ab: %s\n", fm_last_error());
                    goto done;
                }
                us[i][r] = res.us_per_layer;
            }
        for (int i = 0; i < 2; i++) qsort(us[i], (size_t)rounds, sizeof(double), cmp_double);
        const double a = us[0][rounds / 2], b = us[1][rounds / 2];
        printf("%6d %12.1f %12.1f %8.3f\n", batch[bi], a, b, b / a);
    }
    rc = 0;
done:
    if (layers)
        for (long i = 0; i < n_layers; i++) fm_moe_layer_free(layers[i]);
    free(layers);
    fm_cpu_engine_free(e[0]);
    fm_cpu_engine_free(e[1]);
    return rc;
}
