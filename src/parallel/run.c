/* One call from a device choice to a sharded layer: which transport serves
 * which device lives here, not in each command. */
#include "parallel/parallel_internal.h"
#include "util/util.h"

fm_status fm_dist_open(const fm_dist_opts *o, fm_device dev, int mpi, fm_cpu_engine *cpu, const fm_model_desc *d,
                       const fm_moe_layer *l, fm_comm **comm, fm_dist **out) {
    if (!comm || !out) return fm_error(FM_E_ARG, "fm_dist_open: NULL output");
    *comm = NULL;
    *out = NULL;
    fm_status s = fm_dist_check(d, l, o);
    if (s) return s;
    if (dev == FM_DEV_CPU) {
        if (mpi) return fm_error(FM_E_ARG, "MPI ranks need --device cuda (with --device cpu the ranks are simulated)");
        if (!cpu) return fm_error(FM_E_ARG, "fm_dist_open: no CPU engine for --device cpu");
        s = fm_comm_sim_new(o->ranks, comm);
    } else if (dev == FM_DEV_CUDA) {
        s = mpi ? fm_comm_nccl_new_mpi(comm) : fm_comm_nccl_new(o->ranks, comm);
    } else {
        return fm_error(FM_E_ARG, "fm_dist_open: unknown device %d", (int)dev);
    }
    if (s) return s;
    s = dev == FM_DEV_CPU ? fm_dist_new_cpu(d, l, o, *comm, cpu, out) : fm_dist_new_cuda(d, l, o, *comm, out);
    if (s) {
        fm_comm_free(*comm);
        *comm = NULL;
    }
    return s;
}

fm_status fm_dist_run(const fm_dist_opts *o, fm_device dev, int mpi, fm_cpu_engine *cpu, const fm_model_desc *d,
                      const fm_moe_layer *l, const void *x, fm_dtype xdt, int T, const int32_t *token_ids,
                      fm_moe_out *out, fm_dist_stats *st) {
    fm_comm *c;
    fm_dist *ds;
    fm_status s = fm_dist_open(o, dev, mpi, cpu, d, l, &c, &ds);
    if (s) return s;
    s = fm_dist_forward(ds, x, xdt, T, token_ids, out, st);
    fm_dist_free(ds);
    fm_comm_free(c);
    return s;
}
