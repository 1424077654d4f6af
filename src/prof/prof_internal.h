/* Internals of src/prof shared between its files (not public API). */
#ifndef FM_PROF_INTERNAL_H
#define FM_PROF_INTERNAL_H
#include "fp4moe.h"
#include "util/util.h"

#include <stddef.h>

/* A growable text buffer; on allocation failure it stays failed and
 * fm_sb_finish reports FM_E_NOMEM. */
typedef struct {
    char *buf;
    size_t len, cap;
    int failed;
} fm_sb;
void fm_sb_printf(fm_sb *sb, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
void fm_sb_puts(fm_sb *sb, const char *s);
/* Appends s with HTML/XML special characters escaped. */
void fm_sb_escape(fm_sb *sb, const char *s);
fm_status fm_sb_finish(fm_sb *sb, char **out); /* hands buf to *out */
void fm_sb_free(fm_sb *sb);

/* A row's ms per step as every rendering prints it: "%.3f", or "fused"
 * for a phase an engine runs inside another. */
void fm_prof_fmt_ms(char *buf, size_t cap, const fm_profile *p, int row, double ns);

/* "13.8 % of 16 (expected)" or "n/a (not tiled)". */
void fm_prof_fmt_tile(char *buf, size_t cap, const fm_prof_batch *b);
/* The power baseline as every rendering prints it: "4.55 TB/s for 2.5 s:
 * 697 W mean (100 % of the 700 W limit), SM clock 1971 MHz, throttle
 * sw_power_cap", or why there is none. */
void fm_prof_fmt_read(char *buf, size_t cap, const fm_profile *p);
/* Title of a telemetry metric's counter track and chart; NULL for the
 * metrics not drawn on their own (the power limit is the power chart's
 * scale). */
const char *fm_prof_metric_title(fm_telem_metric m);

/* Kernels of one batch that ran inside its measured steps, by name and
 * phase. */
typedef struct {
    const char *name; /* into the profile's spans */
    int phase;
    double launches;  /* per step */
    double us;        /* per step */
} fm_prof_kernel_row;
/* Fills up to cap rows, sorted by time per step, descending; returns the
 * count (0 when the batch has no kernel records). *steps: steps seen. */
int fm_prof_kernel_rows(const fm_profile *p, int batch_index, fm_prof_kernel_row *rows, int cap, int *steps);

/* Colour of a table row / phase in the charts. */
const char *fm_prof_row_color(int row);

#endif
