/* libFuzzer target: fm_model_desc_parse (+ validate, the config writer and
 * the layer pattern) on arbitrary bytes. The input is split at the first NUL
 * byte: config.json before it, hf_quant_config.json after it (if any). */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fp4moe.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const char *cfg = (const char *)data;
    const uint8_t *nul = memchr(data, 0, size);
    size_t cl = nul ? (size_t)(nul - data) : size;
    const char *q = nul ? (const char *)nul + 1 : NULL;
    size_t ql = nul ? size - cl - 1 : 0;
    fm_model_desc d;
    if (fm_model_desc_parse(cfg, cl, q, ql, &d) != FM_OK) return 0;
    if (fm_model_desc_validate(&d) != FM_OK) return 0;
    int n = 0;
    for (int l = 0; l < d.n_layers && l < 4096; l++) n += fm_model_is_moe_layer(&d, l);
    (void)n;
    (void)fm_model_expert_bytes(&d, d.expert_format);
    char *c = NULL, *h = NULL;
    if (fm_model_desc_to_json(&d, &c, &h) == FM_OK) {
        fm_model_desc back;
        /* what we write must read back to the same description */
        if (fm_model_desc_parse(c, strlen(c), h, h ? strlen(h) : 0, &back) != FM_OK) abort();
        if (memcmp(&back, &d, sizeof d) != 0) abort();
    }
    free(c);
    free(h);
    return 0;
}
