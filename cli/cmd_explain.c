/* fp4moe explain: print which kernel and config would run, and why. */
#include "cli.h"
#include "dist_opts.h"

#include <stdio.h>
#include <string.h>

#define MAX_BATCHES 64

static void explain_usage(FILE *f) {
    fprintf(f,
            "usage: fp4moe explain (--model DIR | --preset NAME) [--batch LIST] [--gpu NAME]\n"
            "                      [--format nvfp4|mxfp4|bf16] [--json] [--shard tp:R[/r] | ep:R/r]\n\n"
            "Prints the kernel decision for each batch size (default 1,16,64,256): expected\n"
            "active experts and tokens per expert, the bytes to stream and their floor, the\n"
            "paths considered, the built-in default, the tuned-config lookup directory by\n"
            "directory ($FP4MOE_CONFIG_DIR, the user cache, the shipped configs) and what\n"
            "would run, with its provenance line. Nothing is run on the GPU.\n\n"
            "--gpu NAME   plan for a GPU that is not present (tuned files for it apply);\n"
            "             without --gpu: the present GPU, else the CPU path.\n"
            "--format     expert format (default: the model's own)\n"
            "--json       one JSON document instead of text\n"
            "--shard S    one rank's share: tp:R[/r] (the I/R slices) or ep:R/r (experts\n"
            "             r*E/R..(r+1)*E/R-1); shape, config key, bytes and floor are the rank's\n\nknown GPUs:");
    for (size_t i = 0; i < fm_gpu_count(); i++) fprintf(f, "%s \"%s\"", i ? "," : "", fm_gpu_at(i)->name);
    fprintf(f, "\n");
}

int fm_cmd_explain(int argc, char **argv) {
    const char *model = NULL, *preset = NULL, *gpu = NULL, *fmt_s = NULL, *batch_s = "1,16,64,256";
    int json = 0;
    fm_shard shard = {0};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) { explain_usage(stdout); return 0; }
        if (!strcmp(a, "--json")) { json = 1; continue; }
        int sr = fm_cli_shard_parse("explain", argc, argv, &i, &shard);
        if (sr < 0) return 2;
        if (sr) continue;
        if (!v) { fprintf(stderr, "fp4moe explain: error: %s needs a value\n", a); return 2; }
        if (!strcmp(a, "--model")) model = v;
        else if (!strcmp(a, "--preset")) preset = v;
        else if (!strcmp(a, "--gpu")) gpu = v;
        else if (!strcmp(a, "--format")) fmt_s = v;
        else if (!strcmp(a, "--batch")) batch_s = v;
        else {
            fprintf(stderr, "fp4moe explain: error: unknown option '%s'\n\n", a);
            explain_usage(stderr);
            return 2;
        }
        i++;
    }
    if (!!model == !!preset) {
        fprintf(stderr, "fp4moe explain: error: give exactly one of --model DIR or --preset NAME\n\n");
        explain_usage(stderr);
        return 2;
    }
    int batches[MAX_BATCHES];
    int nb = fm_cli_parse_int_list("explain", batch_s, batches, MAX_BATCHES);
    if (nb < 0) return 2;
    fm_qformat fmt;
    if (fm_cli_parse_format("explain", fmt_s, &fmt)) return 2;
    fm_model_desc d;
    fm_status s = preset ? fm_preset_desc(preset, fmt, &d) : fm_model_desc_load(model, &d);
    if (s) return fm_cli_fail("explain", s);
    if (fmt == FM_QF_NONE) fmt = d.expert_format != FM_QF_NONE ? d.expert_format : FM_QF_NVFP4;
    if (fm_cli_shard_check("explain", &shard, preset, model, fmt)) return 2;

    char label[1200];
    snprintf(label, sizeof label, "%s %s", preset ? "--preset" : "--model", preset ? preset : model);
    fm_explain_opts o = {.desc = &d, .model_label = label, .fmt = fmt, .batches = batches, .n_batches = nb, .gpu = gpu,
                         .shard = shard.mode ? &shard : NULL};
    fm_explanation *x = NULL;
    s = fm_explain_decide(&o, &x);
    if (s) return fm_cli_fail("explain", s);
    /* Ignored config files are a warning on stderr too, where scripts and
     * logs notice them, not only inside the explanation. */
    for (const char *p = x->warnings; *p;) {
        const char *e = strchr(p, '\n');
        int n = e ? (int)(e - p) : (int)strlen(p);
        fprintf(stderr, "fp4moe explain: warning: %.*s\n", n, p);
        p += n + (e ? 1 : 0);
    }
    s = json ? fm_explain_render_json(x, stdout) : fm_explain_render_text(x, stdout);
    fm_explanation_free(x);
    if (s) return fm_cli_fail("explain", s);
    return fflush(stdout) == 0 ? 0 : 1;
}
