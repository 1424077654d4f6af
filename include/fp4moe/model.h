/* safetensors, checkpoints, model descriptions; included by fp4moe.h (users include fp4moe.h). */
#ifndef FP4MOE_MODEL_H
#define FP4MOE_MODEL_H

#ifndef FP4MOE_H
#error "include fp4moe.h, not fp4moe/model.h"
#endif

/* ------------------------------------------------------------ safetensors */

#define FM_MAX_DIMS 8

typedef struct {
    const char *name;
    fm_dtype dtype;
    int ndim;
    int64_t shape[FM_MAX_DIMS];
    uint64_t begin, end; /* offsets in the data buffer                */
    const void *data;    /* into the mapping (NULL for header-only)   */
} fm_st_tensor;

typedef struct fm_st_file fm_st_file;

/* Maps and validates a file with the official reader's rules. */
fm_status fm_st_open(const char *path, fm_st_file **out);
/* Reads only the header (no mapping of the data). data pointers are NULL. */
fm_status fm_st_open_header(const char *path, fm_st_file **out);
/* Parses a header from memory: buf = the whole file (or its first bytes),
 * file_size = the full size of the file. Used by the fuzzer and tests.
 * When buf holds the whole file, data pointers point into buf; else NULL.
 * Errors: FM_E_FORMAT malformed, FM_E_RANGE header > 100 MB or shape
 * product overflow, FM_E_UNSUPPORTED unknown dtype or ndim > FM_MAX_DIMS. */
fm_status fm_st_parse(const uint8_t *buf, size_t buf_len, uint64_t file_size,
                      fm_st_file **out);
void fm_st_close(fm_st_file *f);
size_t fm_st_count(const fm_st_file *f);
const fm_st_tensor *fm_st_at(const fm_st_file *f, size_t i); /* sorted by offset */
const fm_st_tensor *fm_st_find(const fm_st_file *f, const char *name);
const char *fm_st_metadata(const fm_st_file *f, const char *key);
size_t fm_st_metadata_count(const fm_st_file *f);
const char *fm_st_path(const fm_st_file *f);

/* Streaming writer: declare every tensor first, then write their bytes in
 * declaration order. The file appears (atomic rename) only at finish; abort
 * or any error leaves no file behind. */
typedef struct fm_st_writer fm_st_writer;
fm_status fm_st_writer_new(const char *path, fm_st_writer **out);
fm_status fm_st_writer_meta(fm_st_writer *w, const char *key, const char *val);
fm_status fm_st_writer_declare(fm_st_writer *w, const char *name, fm_dtype dt,
                               int ndim, const int64_t *shape);
fm_status fm_st_writer_write(fm_st_writer *w, const void *data, size_t n);
fm_status fm_st_writer_finish(fm_st_writer *w); /* frees w */
void fm_st_writer_abort(fm_st_writer *w);       /* frees w */

/* A checkpoint directory: model.safetensors.index.json + shards, or a single
 * model.safetensors. Shards are opened on first use. */
typedef struct fm_ckpt fm_ckpt;
fm_status fm_ckpt_open(const char *dir, fm_ckpt **out);
void fm_ckpt_close(fm_ckpt *c);
/* NULL (with fm_last_error set) when absent or when its shard is bad. */
const fm_st_tensor *fm_ckpt_find(fm_ckpt *c, const char *name);
const char *fm_ckpt_dir(const fm_ckpt *c);
/* Names of all tensors (from the index or the single file). */
size_t fm_ckpt_count(const fm_ckpt *c);
const char *fm_ckpt_name_at(const fm_ckpt *c, size_t i);

/* ------------------------------------------------------- model description */

typedef enum {
    FM_ROUTE_NOAUX_TC = 1, /* DeepSeek-V3/R1, Kimi-K2, GLM-4.5/5            */
    FM_ROUTE_SOFTMAX,      /* Qwen3-MoE, Mixtral                            */
    FM_ROUTE_GPTOSS,       /* top-k on biased logits, softmax over the k    */
    FM_ROUTE_DSV4          /* sqrt(softplus), bias top-k, hash layers       */
} fm_route_kind;

typedef enum {
    FM_ACT_SILU = 1,    /* silu(gate) * up                                   */
    FM_ACT_GPTOSS       /* clamp; gate*sigmoid(alpha*gate)*(up+1)            */
} fm_act_kind;

typedef struct {
    char family[32];     /* deepseek_v3 kimi_k2 glm4_moe glm5 deepseek_v4
                            qwen3_moe mixtral gpt_oss                         */
    char model_type[64]; /* config.json model_type as read                  */
    int hidden;          /* H                                               */
    int moe_inter;       /* I, per routed expert                            */
    int n_experts;       /* E                                               */
    int topk;            /* k                                               */
    int n_shared;        /* shared experts (0 if none)                      */
    int shared_inter;    /* intermediate size of the fused shared expert    */
    int n_layers;
    int first_dense;     /* first_k_dense_replace (layers < it are dense)   */
    int moe_layer_freq;  /* every n-th layer is MoE (1 = all)               */
    int n_group, topk_group;
    int norm_topk_prob;  /* renormalize the top-k weights                   */
    float routed_scaling_factor;
    fm_route_kind route;
    fm_act_kind act;
    float swiglu_alpha, swiglu_limit;
    int n_hash_layers;   /* DeepSeek-V4: first layers route by token id     */
    int vocab_size;
    fm_qformat expert_format; /* from hf_quant_config / quantization_config */
    int group_size;
    char layout[32];     /* modelopt | gptoss | dsv4 | bf16                 */
} fm_model_desc;

/* Reads DIR/config.json (+ DIR/hf_quant_config.json when present). */
fm_status fm_model_desc_load(const char *dir, fm_model_desc *out);
/* Same from strings (quant_json may be NULL). Fuzzed. */
fm_status fm_model_desc_parse(const char *config_json, size_t config_len,
                              const char *quant_json, size_t quant_len,
                              fm_model_desc *out);
fm_status fm_model_desc_validate(const fm_model_desc *d);
int fm_model_is_moe_layer(const fm_model_desc *d, int layer);
/* NVFP4/MXFP4/BF16 bytes of one routed expert (3 matrices, with scales). */
int64_t fm_model_expert_bytes(const fm_model_desc *d, fm_qformat f);

/* Built-in presets named after real models, and tiny ones for tests. */
size_t fm_preset_count(void);
const char *fm_preset_name(size_t i);
fm_status fm_preset_desc(const char *name, fm_qformat fmt, fm_model_desc *out);

/* @section io begin */
/* config.json (and hf_quant_config.json for the modelopt layout, else NULL)
 * of a description, with the family's real key names. Free with free(). */
fm_status fm_model_desc_to_json(const fm_model_desc *d, char **config_json, char **quant_json);

/*
 * Seeded random weights: the exact formulas are documented in
 * src/io/model_random.c so that any generator (CPU, GPU) reproduces them.
 * Stream key of one logical tensor part: expert -1 is the fused shared
 * expert, -2 the router; what is e.g. "gate.codes", "down.scales".
 */
uint64_t fm_gen_key(int layer, int expert, const char *what);
/* Per-tensor constants of the formulas for a matrix with K inputs. */
float fm_gen_nvfp4_scale2(int64_t K);
int fm_gen_mxfp4_base_exp(int64_t K);
/* Fills rows [r0, r0+nr) of a routed / shared matrix (rows x K) of layer
 * `layer`, expert e (-1 shared), m = 0 gate, 1 up, 2 down, in format fmt:
 * packed (nr*K/2 bytes, or nr*K*2 for BF16) and scales (nr*K/block bytes,
 * NULL for BF16; either may be NULL to skip it). Used by
 * fm_moe_layer_random and gen. */
void fm_gen_matrix_rows(uint64_t seed, int layer, int e, int m, fm_qformat fmt, int64_t K, int64_t r0, int64_t nr,
                        uint8_t *packed, uint8_t *scales);

typedef struct {
    int n_moe_layers;     /* MoE layers to write, from the first one (>= 1)  */
    uint64_t seed;
    uint64_t shard_bytes; /* maximum bytes per shard; 0: 2 GB                */
    int progress;         /* progress lines on stderr (about once a second)  */
} fm_gen_opts;
/* Writes a checkpoint of d (config.json, hf_quant_config.json for modelopt,
 * model-0000i-of-0000N.safetensors shards, model.safetensors.index.json)
 * into out_dir, which must not exist. Everything is written into a sibling
 * temporary directory that is renamed at the end: a failure leaves nothing.
 * num_hidden_layers keeps the real model's count; only the chosen MoE layers
 * hold tensors (fm_inspect lists them). Memory use is independent of size. */
fm_status fm_gen_checkpoint(const fm_model_desc *d, const fm_gen_opts *o, const char *out_dir);

/* Describes a checkpoint directory (family, MoE layers present, experts,
 * formats, bytes, routing) and checks every tensor of every present MoE
 * layer. Writes text or JSON to out. *n_problems counts what is wrong; the
 * status is FM_OK whenever the report could be written (problems included). */
fm_status fm_inspect(const char *dir, int as_json, FILE *out, int *n_problems);
/* @section io end */

#endif /* FP4MOE_MODEL_H */
