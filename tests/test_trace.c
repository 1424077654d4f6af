/* Trace analyzer: hand-worked cases for the reader, categories, steps,
 * statistics, output formats and every kind of malformed input. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "fm_test.h"
#include "fp4moe.h"
#include "trace/trace_internal.h"

#define US 1e-9 /* tolerance on microsecond figures printed from integer ns */

static fm_trace *open_doc(const char *doc, const fm_trace_options *o) {
    fm_trace *t = NULL;
    fm_status s = fm_trace_open_mem(doc, strlen(doc), o, &t);
    if (s != FM_OK) print_message("unexpected error: %s\n", fm_last_error());
    assert_int_equal(s, FM_OK);
    return t;
}

static const fm_trace_kernel *kernel(const fm_trace *t, int rank, const char *name) {
    const fm_trace_kernel *k;
    size_t n = fm_trace_kernels(t, rank, &k);
    for (size_t i = 0; i < n; i++)
        if (strcmp(k[i].name, name) == 0) return &k[i];
    return NULL;
}

/* Expects failure with a message containing every given fragment. */
static void expect_error(const char *doc, size_t len, const char *frag1, const char *frag2) {
    fm_trace *t = NULL;
    fm_status s = fm_trace_open_mem(doc, len, NULL, &t);
    if (s == FM_OK) print_message("accepted: %.*s\n", (int)(len > 200 ? 200 : len), doc);
    assert_int_not_equal(s, FM_OK);
    assert_null(t);
    const char *m = fm_last_error();
    if ((frag1 && !strstr(m, frag1)) || (frag2 && !strstr(m, frag2)))
        print_message("message '%s' lacks '%s' / '%s'\n", m, frag1 ? frag1 : "", frag2 ? frag2 : "");
    if (frag1) assert_non_null(strstr(m, frag1));
    if (frag2) assert_non_null(strstr(m, frag2));
}

static const char *k_basic =
    "{\"schemaVersion\": 1, \"deviceProperties\": [{\"id\": 0, \"name\": \"H200\"}],\n"
    " \"traceEvents\": [\n"
    "  {\"ph\": \"X\", \"cat\": \"kernel\", \"name\": \"fused_moe_kernel\", \"pid\": 0, \"tid\": 7, \"ts\": 100.0,"
    " \"dur\": 10.5, \"args\": {\"correlation\": 1, \"grid\": [1, 2, 3], \"blocks per SM\": \"inf\"}},\n"
    "  {\"ph\": \"X\", \"cat\": \"Kernel\", \"name\": \"fused_moe_kernel\", \"pid\": 0, \"tid\": 7, \"ts\": 200,"
    " \"dur\": \"20.5\"},\n"
    "  {\"ph\": \"X\", \"cat\": \"kernel\", \"name\": \"fused_moe_kernel\", \"pid\": 0, \"tid\": 7, \"ts\": 3e2,"
    " \"dur\": 30},\n"
    "  {\"ph\": \"X\", \"cat\": \"kernel\", \"name\": \"fused_moe_kernel\", \"pid\": 0, \"tid\": 7, \"ts\": 400,"
    " \"dur\": 40.0000},\n"
    "  {\"ph\": \"X\", \"cat\": \"cpu_op\", \"name\": \"aten::mm\", \"pid\": 1, \"tid\": 1, \"ts\": 1, \"dur\": \"x\"},\n"
    "  {\"ph\": \"X\", \"cat\": \"gpu_memcpy\", \"name\": \"Memcpy HtoD (Pinned -> Device)\", \"pid\": 0, \"tid\": 8,"
    " \"ts\": 150, \"dur\": 5},\n"
    "  {\"name\": \"process_name\", \"ph\": \"M\", \"pid\": \"Spans\", \"tid\": 0, \"args\": {\"name\": \"x\"}},\n"
    "  {\"ph\": \"f\", \"id\": 1, \"pid\": 0, \"tid\": 7, \"ts\": 100, \"cat\": \"ac2g\", \"name\": \"ac2g\"}\n"
    " ],\n \"traceName\": \"t\", \"displayTimeUnit\": \"ms\"}\n";

static void test_kernel_stats(void **state) {
    (void)state;
    fm_trace *t = open_doc(k_basic, NULL);
    const fm_trace_kernel *k = kernel(t, -1, "fused_moe_kernel");
    assert_non_null(k);
    /* durations 10.5, 20.5, 30, 40 us */
    assert_int_equal(k->count, 4);
    assert_float_equal(k->total_us, 101.0, US);
    assert_float_equal(k->mean_us, 25.25, US);
    assert_float_equal(k->p50_us, 25.25, US);        /* (20.5 + 30) / 2          */
    assert_float_equal(k->p90_us, 30 + 0.7 * 10, US); /* rank 2.7                 */
    assert_float_equal(k->p99_us, 30 + 0.97 * 10, US);
    assert_float_equal(k->max_us, 40.0, US);
    assert_string_equal(k->category, "moe_gemm");
    const fm_trace_kernel *m = kernel(t, -1, "Memcpy HtoD (Pinned -> Device)");
    assert_non_null(m);
    assert_string_equal(m->category, "memory");
    assert_int_equal(m->count, 1);
    assert_null(kernel(t, -1, "aten::mm"));
    /* no annotations: one step over the whole trace, [100, 440) us */
    fm_trace_step_info si;
    assert_int_equal(fm_trace_step_summary(t, -1, &si), FM_OK);
    assert_int_equal(si.n_steps, 1);
    assert_non_null(strstr(si.method, "whole trace"));
    assert_float_equal(si.wall_ms, 0.340, 1e-12);
    assert_float_equal(si.busy_ms, (10.5 + 5 + 20.5 + 30 + 40) / 1e3, 1e-12);
    assert_float_equal(fm_trace_category_ms(t, -1, "moe_gemm"), 0.101, 1e-12);
    assert_float_equal(fm_trace_category_ms(t, -1, "memory"), 0.005, 1e-12);
    fm_trace_free(t);
}

static void test_categories(void **state) {
    (void)state;
    static const char *const cases[][2] = {
        {"void flash::flash_fwd_splitkv_mla_kernel<Flash_fwd_kernel_traits_mla<576, 64, 64, 8, cutlass::bfloat16_t, 512>, "
         "true>(Flash_fwd_mla_params)",
         "attention"},
        {"_ZN5flash30flash_fwd_splitkv_mla_kernelI26Flash_fwd_kernel_traits_mlaILi576ELi64EEEEvRK18Flash_fwd_mla_params",
         "attention"},
        {"void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<flash::CollectiveMainloopFwdSm90"
         "<2, cute::tuple<cute::C<1> > > > > >(flash::FlashAttnFwdSm90::Params)",
         "attention"},
        {"BatchMLAPagedAttentionKernel<true, 512, 64>", "attention"},
        {"fused_moe_kernel", "moe_gemm"},
        {"void marlin_moe_wna16::Marlin<__nv_bfloat16, 4, 8, 8, true>(int4 const*)", "moe_gemm"},
        {"bmm_E2m1_E2m1E2m1_Fp32_t128x8x256u2_s6_et64x8_m64x8x64_cga1x1x1_16dp256b_TN_transOut_schedS_bN_dynBatch_sm100f",
         "moe_gemm"},
        {"void deep_gemm::fp8_gemm_kernel<128u, 128u, (deep_gemm::GemmType)GroupedMasked>(float*)", "moe_gemm"},
        {"ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "comm"},
        {"void cross_device_reduce_2stage<__nv_bfloat16, 8>(RankData*, RankSignals, Signal*, __nv_bfloat16*, int, int)",
         "comm"},
        {"void per_token_group_quant_8bit_kernel<__nv_bfloat16, c10::Float8_e4m3fn, false>(__nv_bfloat16 const*)",
         "moe_quant"},
        {"_Z25per_token_group_quant_8bitPKvPvPfiiffb", "moe_quant"},
        {"void cvt_fp16_to_fp4<__nv_bfloat16, false>(int, int, long, int*)", "moe_quant"},
        {"void moe_fused_gate_kernel<float, 256, 8, 4>(void*, void*, float*, int*, long)", "moe_routing"},
        {"void moe_align_block_size_kernel<int>(int const*, int*, int*, int*, int, int, int, unsigned long)", "moe_routing"},
        {"void topkGatingSoftmax<8, 128, 4, 16, 32, int>(float const*, bool const*, float*, int, int*)", "moe_routing"},
        {"void count_and_sort_expert_tokens_kernel<int>(int const*, int*, int*, unsigned long)", "moe_routing"},
        {"void act_and_mul_kernel<c10::BFloat16, &silu_kernel<c10::BFloat16>, false>(c10::BFloat16*, int)", "moe_act"},
        {"nvjet_tst_64x8_64x16_4x1_v_bz_splitK_TNT", "gemm"},
        {"sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel",
         "gemm"},
        {"void cutlass::Kernel<cutlass_80_tensorop_s1688gemm_64x64_32x6_tn_align4>(cutlass_80_tensorop_s1688gemm_64x64_"
         "32x6_tn_align4::Params)",
         "gemm"},
        {"Cijk_Alik_Bljk_SB_Bias_AS_SAV_UserArgs_MT64x16x32_MI16x16x1_SN_LDSB0", "gemm"},
        {"void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, at::detail::Array<char*, "
         "3> >(int, at::native::CUDAFunctor_add<float>, at::detail::Array<char*, 3>)",
         "glue"},
        {"void flashinfer::norm::RMSNormKernel<8u, __nv_bfloat16>(__nv_bfloat16*, unsigned int)", "glue"},
        {"triton_poi_fused_add_cos_sin_0", "glue"},
        {"Memcpy DtoD (Device -> Device)", "memory"},
        {"Memset (Device)", "memory"},
        {"paged_attention_v1_kernel<__nv_bfloat16, 128, 16>", "attention"},
        {"void vllm::reshape_and_cache_flash_kernel<__nv_bfloat16>(__nv_bfloat16 const*)", "attention"},
        {"create_flashinfer_kv_indices_triton", "attention"},
        {"_fwd_grouped_kernel_stage1", "attention"},
        {"void vllm::rms_norm_kernel<c10::BFloat16>(c10::BFloat16*)", "glue"},
        {"void vllm::moe::moe_sum_kernel<c10::BFloat16, 8>(c10::BFloat16*)", "moe_routing"},
        {"void tensorrt_llm::kernels::finalizeMoeRoutingKernel<float>(float const*)", "moe_routing"},
        {"void tensorrt_llm::kernels::expandInputRowsKernel<__nv_bfloat16>(__nv_bfloat16 const*)", "moe_routing"},
        {"fmha_v2_flash_attention_bf16_64_128_S_qkv_128_sm90_kernel", "attention"},
        {"cutlass_scaled_mm_sm90_fp8", "gemm"},
        {"void cublasLt::splitKreduce_kernel<32, 16, int, float>(cublasLt::cublasSplitKParams<float>)", "gemm"},
        {"void cross_device_reduce_1stage<__nv_bfloat16, 8>(RankData*)", "comm"},
        {"some_unknown_kernel_xyz", "other"},
        /* fp4moe's own kernels */
        {"void fm_expert_kernel<2, 3, 2>(fm_expert_params, int, int)", "moe_gemm"},
        {"_Z19fm_expert_wg_kernelILi2ELi2EEv16fm_expert_paramsii", "moe_gemm"},
        {"fm_shared_expert_wg_kernel(fm_expert_params, int, int)", "moe_gemm"},
        {"void fm_splitk_gu_kernel<true>(int)", "moe_gemm"},
        {"void fm_splitk_down_kernel<2, 4, false>(int)", "moe_gemm"},
        {"void fm_fused1_kernel<false>(fm_expert_params, fm_fused1_layout)", "moe_gemm"},
        {"fm_route_kernel(fm_route_params)", "moe_routing"},
        {"fm_prep_kernel(fm_route_params)", "moe_routing"},
        {"fm_preroute_kernel(fm_route_params)", "moe_routing"},
        {"fm_logits_gemv_kernel(fm_route_params)", "moe_routing"},
        {"void fm_logits_bf16_kernel<4>(fm_route_params, int)", "moe_routing"},
        /* a transformers decode step: SDPA attention and the static KV cache */
        {"fmha_cutlassF_bf16_aligned_64x128_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::bfloat16_t, "
         "cutlass::arch::Sm80, true, 64, 128, 128, true, true>::Params)",
         "attention"},
        {"void pytorch_flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128, 64, 128, 4, false, false, "
         "cutlass::bfloat16_t>, false, true, false, false, true, true, false, false>(pytorch_flash::Flash_fwd_params)",
         "attention"},
        {"cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_kernel0_0", "attention"},
        {"void at::native::index_elementwise_kernel<128, 4, at::native::index_copy_kernel_impl<at::native::OpaqueType<2> "
         ">(at::TensorIterator&, long, long, long)::{lambda(int)#1}>(long, at::native::index_copy_kernel_impl<"
         "at::native::OpaqueType<2> >(at::TensorIterator&, long, long, long)::{lambda(int)#1})",
         "attention"},
        /* transformers' grouped_mm experts: sort by expert, count, grouped GEMM */
        {"void cutlass::device_kernel<at::cuda::detail::enable_3x_kernel_for_sm9x<cutlass::gemm::kernel::GemmUniversal<"
         "cutlass::gemm::GroupProblemShape<cute::tuple<int, int, int> >, cutlass::gemm::collective::CollectiveMma<> > > "
         ">(at::cuda::detail::enable_3x_kernel_for_sm9x::Params)",
         "moe_gemm"},
        {"void at::cuda::detail::prepare_grouped_gemm_data<cutlass::bfloat16_t, cutlass::bfloat16_t, "
         "cutlass::bfloat16_t, float>(cutlass::bfloat16_t*, cutlass::bfloat16_t*)",
         "moe_gemm"},
        {"void at::native::radixSortKVInPlace<-2, -1, 128, 32, long, long, unsigned int>(at::cuda::detail::TensorInfo<"
         "long, unsigned int>, unsigned int, unsigned int, unsigned int, at::cuda::detail::TensorInfo<long, unsigned "
         "int>, unsigned int, bool)",
         "moe_routing"},
        {"void at::native::bitonicSortKVInPlace<-2, -1, 16, 16, long, long, at::native::LTOp<long, true>, unsigned int>"
         "(at::cuda::detail::TensorInfo<long, unsigned int>, unsigned int)",
         "moe_routing"},
        {"void at::native::warpMergeSortKVInPlace<-2, -1, 128, 4, long, long, at::native::LTOp<long, true>, unsigned "
         "int>(at::cuda::detail::TensorInfo<long, unsigned int>, unsigned int)",
         "moe_routing"},
        {"void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>(at::cuda::detail::TensorInfo<float const, "
         "unsigned int>, unsigned int, unsigned int, bool, unsigned int)",
         "moe_routing"},
        {"void at::native::mbtopk::radixFindKthValues<float, unsigned int, unsigned int, 2>(at::cuda::detail::TensorInfo"
         "<float const, unsigned int>, unsigned int, unsigned int*)",
         "moe_routing"},
        {"void at::native::mbtopk::computeBlockwiseWithinKCounts<unsigned int>(unsigned int*, short*, unsigned int)",
         "moe_routing"},
        {"void at::cuda::kernelHistogram1D<int, int, unsigned int, 1, 2, -1, (at::cuda::CUDAHistogramMemoryType)0, "
         "at::cuda::CUDA_tensor_histogram<int, int, true>(at::Tensor, at::Tensor, at::Tensor, long, int, int, "
         "at::cuda::TensorArgType, bool)::{lambda(int)#1}>(at::cuda::detail::TensorInfo<int, unsigned int>)",
         "moe_routing"},
        {"void at_cuda_detail::cub::DeviceRadixSortOnesweepKernel<at_cuda_detail::cub::DeviceRadixSortPolicy<long, long,"
         " unsigned int>::Policy900, false, long, long, unsigned int, int, int>(int*, int*, unsigned int*)",
         "moe_routing"},
        /* eager-torch RMSNorm, rotary, residuals, embedding, copies, cuBLAS projections */
        {"void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float, float, float, "
         "float>, unsigned int, float, 4, 4> >(at::native::ReduceOp<float, at::native::MeanOps<float, float, float, "
         "float>, unsigned int, float, 4, 4>)",
         "glue"},
        {"void at::native::vectorized_elementwise_kernel<4, at::native::(anonymous namespace)::silu_kernel("
         "at::TensorIteratorBase&)::{lambda()#1}::operator()() const::{lambda()#5}::operator()() const::"
         "{lambda(c10::BFloat16)#1}, std::array<char*, 2ul> >(int, at::native::(anonymous namespace)::silu_kernel("
         "at::TensorIteratorBase&)::{lambda(c10::BFloat16)#1}, std::array<char*, 2ul>)",
         "glue"},
        {"void at::native::(anonymous namespace)::CatArrayBatchedCopy_vectorized<at::native::(anonymous namespace)::"
         "OpaqueType<2u>, unsigned int, 4, 64, 64, 16>(char*, at::native::(anonymous namespace)::"
         "CatArrInputTensorMetadata<at::native::(anonymous namespace)::OpaqueType<2u>, unsigned int, 64, 64>)",
         "glue"},
        {"void at::native::(anonymous namespace)::indexSelectSmallIndex<c10::BFloat16, long, unsigned int, 2, 2, -2>("
         "at::cuda::detail::TensorInfo<c10::BFloat16, unsigned int>)",
         "glue"},
        {"void at::native::(anonymous namespace)::indexSelectLargeIndex<c10::BFloat16, long, unsigned int, 2, 2, -2, "
         "true>(at::cuda::detail::TensorInfo<c10::BFloat16, unsigned int>)",
         "glue"},
        {"void at::native::(anonymous namespace)::softmax_warp_forward<float, float, float, 7, false, false>(float*, "
         "float const*, int, int, int, bool const*, int, bool)",
         "glue"},
        {"void at::native::(anonymous namespace)::cunn_SoftMaxForward<8, float, float, float, at::native::(anonymous "
         "namespace)::SoftMaxForwardEpilogue>(float*, float const*, int)",
         "glue"},
        {"void at::native::tensor_kernel_scan_innermost_dim<int, std::plus<int> >(int*, int const*, unsigned int, "
         "unsigned int, unsigned int, int, std::plus<int>)",
         "glue"},
        {"void at::native::_scatter_gather_elementwise_kernel<128, 8, at::native::_cuda_scatter_gather_internal_kernel<"
         "false, at::native::OpaqueType<4> >::operator()<at::native::ReduceAdd>(at::TensorIterator&, long, long, "
         "long, at::native::ReduceAdd const&)::{lambda(int)#1}>(int, at::native::ReduceAdd const&)",
         "glue"},
        {"nvjet_sm90_tst_64x8_64x16_4x1_v_bz_splitK_TNT", "gemm"},
        {"void gemv2T_kernel_val<int, int, __nv_bfloat16, __nv_bfloat16, float, 128, 16, 4, 4, false, false, "
         "cublasGemvParamsEx<int, cublasGemvTensorStridedBatched<__nv_bfloat16 const>, cublasGemvTensorStridedBatched<"
         "__nv_bfloat16 const>, cublasGemvTensorStridedBatched<__nv_bfloat16>, float> >(float, float)",
         "gemm"},
        {"void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16, false, "
         "__nv_bfloat16, __nv_bfloat16, false, true, true>(cublasLt::cublasSplitKParams<float>)",
         "gemm"},
    };
    fm_trace *t = open_doc("{\"traceEvents\": []}", NULL);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const char *c = fm_trace_categorize(t, cases[i][0]);
        if (strcmp(c, cases[i][1]) != 0) print_message("%s -> %s, expected %s\n", cases[i][0], c, cases[i][1]);
        assert_string_equal(c, cases[i][1]);
    }
    fm_trace_free(t);
}

static char *write_tmp(const char *name, const char *text) {
    static char path[512];
    snprintf(path, sizeof path, "/tmp/fm_test_trace_%d_%s", (int)getpid(), name);
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
    return path;
}

static void test_user_rules(void **state) {
    (void)state;
    char *p = write_tmp("rules.json", "[{\"regex\": \"dgrad\", \"category\": \"conv\"},"
                                      " {\"regex\": \"^fused_moe\", \"category\": \"my_moe\"}]");
    fm_trace_options o = {0};
    o.rules_path = p;
    fm_trace *t = open_doc(k_basic, &o);
    unlink(p);
    assert_string_equal(fm_trace_categorize(t, "fused_moe_kernel"), "my_moe"); /* user rules come first */
    assert_string_equal(fm_trace_categorize(t, "void cudnn::detail::dgrad_engine<float>"), "conv");
    assert_string_equal(fm_trace_categorize(t, "ncclKernel_AllReduce"), "comm");
    assert_string_equal(kernel(t, -1, "fused_moe_kernel")->category, "my_moe");
    assert_float_equal(fm_trace_category_ms(t, -1, "my_moe"), 0.101, 1e-12);
    fm_trace_free(t);

    static const char *const bad[][2] = {
        {"{\"regex\": \"a\"}", "JSON array"},
        {"[{\"regex\": \"a\"}]", "rule 0"},
        {"[{\"regex\": \"a\", \"category\": \"x\"}, {\"regex\": \"(\", \"category\": \"y\"}]", "rule 1"},
        {"[{\"regex\": \"a\", \"category\": \"x\", \"colour\": 1}]", "unknown key"},
        {"[{\"regex\": \"a\", \"category\": \"total\"}]", "reserved"},
        {"[{\"regex\": \"a\", \"category\": \"has space\"}]", "category"},
        {"[{\"regex\": \"a\", \"category\": \"x\"", "line"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        p = write_tmp("bad_rules.json", bad[i][0]);
        fm_trace *t2 = NULL;
        fm_status s = fm_trace_open_mem(k_basic, strlen(k_basic), &o, &t2);
        unlink(p);
        assert_int_not_equal(s, FM_OK);
        assert_null(t2);
        assert_non_null(strstr(fm_last_error(), "bad_rules.json"));
        if (!strstr(fm_last_error(), bad[i][1])) print_message("'%s' lacks '%s'\n", fm_last_error(), bad[i][1]);
        assert_non_null(strstr(fm_last_error(), bad[i][1]));
    }
}

/* CPU ProfilerStep spans [0,100) and [100,200); the GPU lags by a full step,
 * so only the correlation ids put the kernels in the right step. */
static const char *k_profsteps =
    "{\"traceEvents\": [\n"
    " {\"ph\":\"X\",\"cat\":\"user_annotation\",\"name\":\"ProfilerStep#7\",\"pid\":1,\"tid\":1,\"ts\":0,\"dur\":100},\n"
    " {\"ph\":\"X\",\"cat\":\"user_annotation\",\"name\":\"ProfilerStep#8\",\"pid\":1,\"tid\":1,\"ts\":100,\"dur\":100},\n"
    " {\"ph\":\"X\",\"cat\":\"cuda_runtime\",\"name\":\"cudaLaunchKernel\",\"pid\":1,\"tid\":2,\"ts\":10,\"dur\":1,\"args\":{\"correlation\":1}},\n"
    " {\"ph\":\"X\",\"cat\":\"cuda_runtime\",\"name\":\"cudaLaunchKernel\",\"pid\":1,\"tid\":2,\"ts\":50,\"dur\":1,\"args\":{\"correlation\":2}},\n"
    " {\"ph\":\"X\",\"cat\":\"cuda_runtime\",\"name\":\"cudaGraphLaunch\",\"pid\":1,\"tid\":2,\"ts\":120,\"dur\":1,\"args\":{\"correlation\":3}},\n"
    " {\"ph\":\"X\",\"cat\":\"kernel\",\"name\":\"fused_moe_kernel\",\"pid\":0,\"tid\":7,\"ts\":150,\"dur\":10,\"args\":{\"correlation\":1}},\n"
    " {\"ph\":\"X\",\"cat\":\"kernel\",\"name\":\"ncclDevKernel_AllReduce\",\"pid\":0,\"tid\":9,\"ts\":155,\"dur\":20,\"args\":{\"correlation\":2}},\n"
    " {\"ph\":\"X\",\"cat\":\"kernel\",\"name\":\"fused_moe_kernel\",\"pid\":0,\"tid\":7,\"ts\":250,\"dur\":40,\"args\":{\"correlation\":3}},\n"
    " {\"ph\":\"X\",\"cat\":\"kernel\",\"name\":\"BatchMLAPagedAttentionKernel\",\"pid\":0,\"tid\":7,\"ts\":290,\"dur\":50,\"args\":{\"correlation\":3}},\n"
    " {\"ph\":\"X\",\"cat\":\"kernel\",\"name\":\"fused_moe_kernel\",\"pid\":0,\"tid\":7,\"ts\":400,\"dur\":7,\"args\":{\"correlation\":99}}\n"
    "]}";

static void test_steps_correlation(void **state) {
    (void)state;
    fm_trace *t = open_doc(k_profsteps, NULL);
    fm_trace_step_info si;
    assert_int_equal(fm_trace_step_summary(t, 0, &si), FM_OK);
    assert_int_equal(si.n_steps, 2);
    assert_non_null(strstr(si.method, "correlation"));
    assert_int_equal(si.outside_events, 1); /* correlation 99 has no launch */
    /* step 7: moe 10, comm 20 (overlap [155,160) = 5); step 8: moe 40, attention 50 */
    assert_float_equal(fm_trace_category_ms(t, 0, "moe_gemm"), (10 + 40) / 2.0 / 1e3, 1e-12);
    assert_float_equal(fm_trace_category_ms(t, 0, "comm"), 20 / 2.0 / 1e3, 1e-12);
    assert_float_equal(fm_trace_category_ms(t, 0, "attention"), 50 / 2.0 / 1e3, 1e-12);
    /* windows: [150,175) and [250,340): wall 25 and 90; busy 25 and 90 */
    assert_float_equal(si.wall_ms, (25 + 90) / 2.0 / 1e3, 1e-12);
    assert_float_equal(si.busy_ms, (25 + 90) / 2.0 / 1e3, 1e-12);
    assert_float_equal(si.comm_ms, 20 / 2.0 / 1e3, 1e-12);
    assert_float_equal(si.overlap_ms, 5 / 2.0 / 1e3, 1e-12);
    assert_float_equal(si.gap_ms, (250 - 175) / 1e3, 1e-12);
    const fm_trace_kernel *k = kernel(t, 0, "fused_moe_kernel");
    assert_int_equal(k->count, 3);          /* whole trace            */
    assert_float_equal(k->per_step, 1.0, 1e-12); /* 2 inside 2 steps  */
    assert_float_equal(k->ms_per_step, 0.025, 1e-12);
    fm_trace_free(t);

    /* --steps sglang on a trace without such spans is an error */
    fm_trace_options o = {0};
    o.steps = FM_TRACE_STEPS_SGLANG;
    fm_trace *t2 = NULL;
    assert_int_not_equal(fm_trace_open_mem(k_profsteps, strlen(k_profsteps), &o, &t2), FM_OK);
    assert_non_null(strstr(fm_last_error(), "step[DECODE"));
}

static void test_steps_gpu_and_sglang(void **state) {
    (void)state;
    /* GPU-side spans are used as they are when there are at least as many
     * as CPU-side ones; EXTEND spans are not decode steps */
    const char *doc =
        "[\n"
        " {\"ph\":\"X\",\"cat\":\"user_annotation\",\"name\":\"step[DECODE bs=32]\",\"pid\":1,\"tid\":1,\"ts\":0,\"dur\":50},\n"
        " {\"ph\":\"X\",\"cat\":\"gpu_user_annotation\",\"name\":\"step[DECODE bs=32]\",\"pid\":0,\"tid\":7,\"ts\":100,\"dur\":100},\n"
        " {\"ph\":\"X\",\"cat\":\"gpu_user_annotation\",\"name\":\"step[EXTEND bs=2 toks=4096]\",\"pid\":0,\"tid\":7,\"ts\":200,\"dur\":100},\n"
        " {\"ph\":\"X\",\"cat\":\"gpu_user_annotation\",\"name\":\"step[DECODE bs=33]\",\"pid\":0,\"tid\":7,\"ts\":300,\"dur\":100},\n"
        " {\"ph\":\"X\",\"cat\":\"kernel\",\"name\":\"fused_moe_kernel\",\"pid\":0,\"tid\":7,\"ts\":110,\"dur\":10},\n"
        " {\"ph\":\"X\",\"cat\":\"kernel\",\"name\":\"fused_moe_kernel\",\"pid\":0,\"tid\":7,\"ts\":210,\"dur\":1000},\n"
        " {\"ph\":\"X\",\"cat\":\"kernel\",\"name\":\"fused_moe_kernel\",\"pid\":0,\"tid\":7,\"ts\":310,\"dur\":30}\n"
        "]";
    fm_trace *t = open_doc(doc, NULL);
    fm_trace_step_info si;
    assert_int_equal(fm_trace_step_summary(t, -1, &si), FM_OK);
    assert_int_equal(si.n_steps, 2);
    assert_non_null(strstr(si.method, "GPU timeline"));
    assert_non_null(strstr(si.method, "step[DECODE"));
    assert_int_equal(si.outside_events, 1);
    assert_float_equal(fm_trace_category_ms(t, -1, "moe_gemm"), 0.020, 1e-12);
    assert_float_equal(si.wall_ms, 0.100, 1e-12);
    assert_float_equal(si.idle_ms, 0.080, 1e-12);
    fm_trace_free(t);
}

/* A CUDA-graph replay whose branches ran on several streams: Kineto writes
 * one gpu_user_annotation per stream that ran the step's work, each
 * covering only its stream's kernels, all with the CPU span's External id.
 * Each step is the union of its spans; a kernel of the main stream after a
 * side stream's span (here the elementwise one) is still inside its step. */
static const char *k_graph_streams =
    "{\"traceEvents\": [\n"
    " {\"ph\":\"X\",\"cat\":\"user_annotation\",\"name\":\"ProfilerStep#3\",\"pid\":1,\"tid\":1,\"ts\":0,\"dur\":100,\"args\":{\"External id\":11}},\n"
    " {\"ph\":\"X\",\"cat\":\"user_annotation\",\"name\":\"ProfilerStep#4\",\"pid\":1,\"tid\":1,\"ts\":100,\"dur\":100,\"args\":{\"External id\":12}},\n"
    " {\"ph\":\"X\",\"cat\":\"cuda_runtime\",\"name\":\"cudaGraphLaunch\",\"pid\":1,\"tid\":1,\"ts\":5,\"dur\":1,\"args\":{\"correlation\":10}},\n"
    " {\"ph\":\"X\",\"cat\":\"cuda_runtime\",\"name\":\"cudaGraphLaunch\",\"pid\":1,\"tid\":1,\"ts\":105,\"dur\":1,\"args\":{\"correlation\":20}},\n"
    " {\"ph\":\"X\",\"cat\":\"kernel\",\"name\":\"fmha_cutlassF_bf16\",\"pid\":0,\"tid\":7,\"ts\":50,\"dur\":10,\"args\":{\"correlation\":10}},\n"
    " {\"ph\":\"X\",\"cat\":\"kernel\",\"name\":\"fm_expert_gateup\",\"pid\":0,\"tid\":7,\"ts\":62,\"dur\":10,\"args\":{\"correlation\":10}},\n"
    " {\"ph\":\"X\",\"cat\":\"kernel\",\"name\":\"fm_expert_gateup\",\"pid\":0,\"tid\":30,\"ts\":63,\"dur\":5,\"args\":{\"correlation\":10}},\n"
    " {\"ph\":\"X\",\"cat\":\"kernel\",\"name\":\"elementwise_kernel\",\"pid\":0,\"tid\":7,\"ts\":90,\"dur\":10,\"args\":{\"correlation\":10}},\n"
    " {\"ph\":\"X\",\"cat\":\"kernel\",\"name\":\"fmha_cutlassF_bf16\",\"pid\":0,\"tid\":7,\"ts\":150,\"dur\":10,\"args\":{\"correlation\":20}},\n"
    " {\"ph\":\"X\",\"cat\":\"kernel\",\"name\":\"fm_expert_gateup\",\"pid\":0,\"tid\":7,\"ts\":162,\"dur\":10,\"args\":{\"correlation\":20}},\n"
    " {\"ph\":\"X\",\"cat\":\"kernel\",\"name\":\"fm_expert_gateup\",\"pid\":0,\"tid\":31,\"ts\":163,\"dur\":5,\"args\":{\"correlation\":20}},\n"
    " {\"ph\":\"X\",\"cat\":\"kernel\",\"name\":\"elementwise_kernel\",\"pid\":0,\"tid\":7,\"ts\":190,\"dur\":10,\"args\":{\"correlation\":20}},\n"
    " {\"ph\":\"X\",\"cat\":\"gpu_user_annotation\",\"name\":\"ProfilerStep#3\",\"pid\":0,\"tid\":7,\"ts\":50,\"dur\":50,\"args\":{\"External id\":11}},\n"
    " {\"ph\":\"X\",\"cat\":\"gpu_user_annotation\",\"name\":\"ProfilerStep#3\",\"pid\":0,\"tid\":30,\"ts\":63,\"dur\":5,\"args\":{\"External id\":\"11\"}},\n"
    " {\"ph\":\"X\",\"cat\":\"gpu_user_annotation\",\"name\":\"ProfilerStep#4\",\"pid\":0,\"tid\":7,\"ts\":150,\"dur\":50,\"args\":{\"External id\":12}},\n"
    " {\"ph\":\"X\",\"cat\":\"gpu_user_annotation\",\"name\":\"ProfilerStep#4\",\"pid\":0,\"tid\":31,\"ts\":163,\"dur\":5,\"args\":{\"External id\":12}}\n"
    "]}";

static void test_steps_graph_streams(void **state) {
    (void)state;
    fm_trace *t = open_doc(k_graph_streams, NULL);
    fm_trace_step_info si;
    assert_int_equal(fm_trace_step_summary(t, -1, &si), FM_OK);
    assert_int_equal(si.n_steps, 2);
    assert_non_null(strstr(si.method, "GPU timeline"));
    assert_int_equal(si.outside_events, 0);
    assert_float_equal(fm_trace_category_ms(t, -1, "attention"), 0.010, 1e-12);
    assert_float_equal(fm_trace_category_ms(t, -1, "moe_gemm"), 0.015, 1e-12);
    assert_float_equal(fm_trace_category_ms(t, -1, "glue"), 0.010, 1e-12);
    assert_float_equal(si.wall_ms, 0.050, 1e-12);
    assert_float_equal(si.busy_ms, 0.030, 1e-12);
    fm_trace_free(t);

    /* without External ids: overlapping spans of one step fold, two steps of
     * the same name (SGLang's bs) that follow each other stay two */
    const char *doc =
        "[\n"
        " {\"ph\":\"X\",\"cat\":\"gpu_user_annotation\",\"name\":\"step[DECODE bs=8]\",\"pid\":0,\"tid\":7,\"ts\":0,\"dur\":100},\n"
        " {\"ph\":\"X\",\"cat\":\"gpu_user_annotation\",\"name\":\"step[DECODE bs=8]\",\"pid\":0,\"tid\":9,\"ts\":20,\"dur\":10},\n"
        " {\"ph\":\"X\",\"cat\":\"gpu_user_annotation\",\"name\":\"step[DECODE bs=8]\",\"pid\":0,\"tid\":7,\"ts\":100,\"dur\":100},\n"
        " {\"ph\":\"X\",\"cat\":\"kernel\",\"name\":\"fused_moe_kernel\",\"pid\":0,\"tid\":7,\"ts\":10,\"dur\":10},\n"
        " {\"ph\":\"X\",\"cat\":\"kernel\",\"name\":\"fused_moe_kernel\",\"pid\":0,\"tid\":9,\"ts\":20,\"dur\":10},\n"
        " {\"ph\":\"X\",\"cat\":\"kernel\",\"name\":\"fused_moe_kernel\",\"pid\":0,\"tid\":7,\"ts\":50,\"dur\":10},\n"
        " {\"ph\":\"X\",\"cat\":\"kernel\",\"name\":\"fused_moe_kernel\",\"pid\":0,\"tid\":7,\"ts\":150,\"dur\":30}\n"
        "]";
    t = open_doc(doc, NULL);
    assert_int_equal(fm_trace_step_summary(t, -1, &si), FM_OK);
    assert_int_equal(si.n_steps, 2);
    assert_int_equal(si.outside_events, 0);
    assert_float_equal(fm_trace_category_ms(t, -1, "moe_gemm"), 0.030, 1e-12);
    fm_trace_free(t);
}

static void test_steps_marker(void **state) {
    (void)state;
    const char *doc =
        "{\"traceEvents\":[\n"
        " {\"ph\":\"X\",\"cat\":\"kernel\",\"name\":\"fused_moe_kernel\",\"pid\":0,\"tid\":7,\"ts\":5,\"dur\":1},\n"
        " {\"ph\":\"X\",\"cat\":\"kernel\",\"name\":\"embedding_kernel\",\"pid\":0,\"tid\":7,\"ts\":10,\"dur\":2},\n"
        " {\"ph\":\"X\",\"cat\":\"kernel\",\"name\":\"fused_moe_kernel\",\"pid\":0,\"tid\":7,\"ts\":20,\"dur\":10},\n"
        " {\"ph\":\"X\",\"cat\":\"kernel\",\"name\":\"embedding_kernel\",\"pid\":0,\"tid\":7,\"ts\":110,\"dur\":2},\n"
        " {\"ph\":\"X\",\"cat\":\"kernel\",\"name\":\"fused_moe_kernel\",\"pid\":0,\"tid\":7,\"ts\":120,\"dur\":30},\n"
        " {\"ph\":\"X\",\"cat\":\"kernel\",\"name\":\"embedding_kernel\",\"pid\":0,\"tid\":7,\"ts\":210,\"dur\":2},\n"
        " {\"ph\":\"X\",\"cat\":\"kernel\",\"name\":\"fused_moe_kernel\",\"pid\":0,\"tid\":7,\"ts\":220,\"dur\":99}\n"
        "]}";
    fm_trace_options o = {0};
    o.steps = FM_TRACE_STEPS_MARKER;
    o.marker = "^embedding";
    fm_trace *t = open_doc(doc, &o);
    fm_trace_step_info si;
    assert_int_equal(fm_trace_step_summary(t, -1, &si), FM_OK);
    assert_int_equal(si.n_steps, 2);          /* 3 markers: 2 complete steps */
    assert_int_equal(si.outside_events, 3);   /* before the first, after the last */
    assert_float_equal(fm_trace_category_ms(t, -1, "moe_gemm"), 0.020, 1e-12);
    assert_float_equal(si.wall_ms, 0.100, 1e-12);
    fm_trace_free(t);
    o.marker = "no_such_kernel";
    fm_trace *t2 = NULL;
    assert_int_equal(fm_trace_open_mem(doc, strlen(doc), &o, &t2), FM_E_NOTFOUND);
    o.marker = "(";
    assert_int_equal(fm_trace_open_mem(doc, strlen(doc), &o, &t2), FM_E_ARG);
}

static void test_begin_end_and_escapes(void **state) {
    (void)state;
    const char *doc =
        "{\"traceEvents\":[\n"
        " {\"ph\":\"B\",\"cat\":\"kernel\",\"name\":\"k\\\"q\\u00e9\\ud83d\\ude00\",\"pid\":0,\"tid\":1,\"ts\":10},\n"
        " {\"ph\":\"B\",\"cat\":\"cpu_op\",\"name\":\"inner\",\"pid\":0,\"tid\":1,\"ts\":11},\n"
        " {\"ph\":\"E\",\"pid\":0,\"tid\":1,\"ts\":12},\n"
        " {\"ph\":\"E\",\"pid\":0,\"tid\":1,\"ts\":15.5},\n"
        " {\"ph\":\"E\",\"pid\":0,\"tid\":3,\"ts\":16}\n"
        "]}";
    fm_trace *t = open_doc(doc, NULL);
    const fm_trace_kernel *k = kernel(t, -1, "k\"q\xc3\xa9\xf0\x9f\x98\x80");
    assert_non_null(k);
    assert_int_equal(k->count, 1);
    assert_float_equal(k->total_us, 5.5, US);
    fm_trace_free(t);
}

/* A reader that hands out one byte at a time: every token crosses a
 * refill boundary somewhere. */
typedef struct {
    const char *p;
    size_t n, off;
} drip;
static fm_status drip_read(void *ctx, uint8_t *dst, size_t cap, size_t *got) {
    drip *d = ctx;
    *got = d->off < d->n && cap ? 1 : 0;
    if (*got) dst[0] = (uint8_t)d->p[d->off++];
    return FM_OK;
}

static void test_chunk_boundaries(void **state) {
    (void)state;
    fm_tr_file a, b;
    assert_int_equal(fm_tr_parse_mem(k_profsteps, strlen(k_profsteps), "mem", &a), FM_OK);
    drip d = {k_profsteps, strlen(k_profsteps), 0};
    assert_int_equal(fm_tr_parse(drip_read, &d, "drip", &b), FM_OK);
    assert_int_equal(a.ngpu, 5);
    assert_int_equal(a.ngpu, b.ngpu);
    assert_int_equal(a.nlaunch, 3);
    assert_int_equal(a.nlaunch, b.nlaunch);
    assert_int_equal(a.nspan, 2);
    assert_int_equal(a.nspan, b.nspan);
    assert_int_equal(a.names.n, b.names.n);
    assert_memory_equal(a.gpu, b.gpu, a.ngpu * sizeof *a.gpu);
    assert_memory_equal(a.launch, b.launch, a.nlaunch * sizeof *a.launch);
    fm_tr_file_free(&a);
    fm_tr_file_free(&b);
    /* escapes and UTF-8 across boundaries */
    const char *doc = "{\"traceEvents\":[{\"ph\":\"X\",\"cat\":\"kernel\",\"name\":\"a\\u00e9\\ud83d\\ude00\xc3\xa9z\","
                      "\"ts\":1.25,\"dur\":2e0}]}";
    drip d2 = {doc, strlen(doc), 0};
    assert_int_equal(fm_tr_parse(drip_read, &d2, "drip", &b), FM_OK);
    assert_int_equal(b.ngpu, 1);
    assert_string_equal(b.names.str[0], "a\xc3\xa9\xf0\x9f\x98\x80\xc3\xa9z");
    assert_int_equal(b.gpu[0].ts, 1250);
    assert_int_equal(b.gpu[0].dur, 2000);
    fm_tr_file_free(&b);
}

/* Every strict prefix of a valid document is an error (truncated file),
 * read all at once or a byte at a time. */
static void test_every_prefix_fails(void **state) {
    (void)state;
    size_t n = strlen(k_basic);
    while (n && (k_basic[n - 1] == '\n' || k_basic[n - 1] == ' ')) n--;
    for (size_t len = 0; len < n; len++) {
        fm_tr_file f;
        fm_status s = fm_tr_parse_mem(k_basic, len, "prefix", &f);
        if (s == FM_OK) print_message("prefix of %zu bytes accepted\n", len);
        assert_int_not_equal(s, FM_OK);
        assert_true(strstr(fm_last_error(), "byte") || strstr(fm_last_error(), "empty"));
        fm_tr_file_free(&f);
        drip d = {k_basic, len, 0};
        assert_int_not_equal(fm_tr_parse(drip_read, &d, "drip", &f), FM_OK);
        fm_tr_file_free(&f);
    }
}

static void test_malformed(void **state) {
    (void)state;
#define E(doc, a, b) expect_error(doc, strlen(doc), a, b)
    E("", "empty file", NULL);
    E("   \n ", "empty file", NULL);
    E("{\"foo\": 1}", "no \"traceEvents\"", NULL);
    E("[1, 2]", "traceEvents[0] is not an object", "byte 1");
    E("5", "not a trace", NULL);
    E("{\"traceEvents\": {}}", "not an array", "byte 16");
    E("{\"traceEvents\": []} x", "trailing data", "byte 20");
    E("{\"traceEvents\": [], \"traceEvents\": []}", "twice", NULL);
    /* NaN / Infinity are not JSON */
    E("{\"traceEvents\":[{\"ph\":\"X\",\"cat\":\"kernel\",\"name\":\"k\",\"ts\":1,\"dur\":NaN}]}", "NaN", "byte 65");
    E("{\"traceEvents\":[{\"ph\":\"X\",\"cat\":\"kernel\",\"name\":\"k\",\"ts\":1,\"dur\":-Infinity}]}", "NaN", "byte 65");
    E("{\"traceEvents\":[{\"ph\":\"X\",\"cat\":\"kernel\",\"name\":\"k\",\"ts\":1,\"dur\":\"nan\"}]}", "finite", "byte 65");
    E("{\"traceEvents\":[{\"ph\":\"X\",\"cat\":\"kernel\",\"name\":\"k\",\"ts\":1,\"dur\":1e400}]}", "finite", NULL);
    /* beyond 2^62 ns: ts + dur could overflow */
    E("{\"traceEvents\":[{\"ph\":\"X\",\"cat\":\"kernel\",\"name\":\"k\",\"ts\":1,\"dur\":5000000000000000}]}", "finite", NULL);
    E("{\"traceEvents\":[{\"ph\":\"X\",\"cat\":\"kernel\",\"name\":\"k\",\"ts\":-4.7e15,\"dur\":1}]}", "\"ts\"", NULL);
    /* wrong types and missing fields of GPU events */
    E("{\"traceEvents\":[{\"ph\":\"X\",\"cat\":\"kernel\",\"name\":\"k\",\"ts\":1,\"dur\":true}]}", "finite", "traceEvents[0]");
    E("{\"traceEvents\":[{\"ph\":\"X\",\"cat\":\"kernel\",\"name\":7,\"ts\":1,\"dur\":1}]}", "not a string", NULL);
    E("{\"traceEvents\":[{},{\"ph\":\"X\",\"cat\":\"kernel\",\"name\":\"k\",\"ts\":1}]}", "no \"dur\"", "traceEvents[1]");
    E("{\"traceEvents\":[{\"ph\":\"X\",\"cat\":\"kernel\",\"name\":\"k\",\"dur\":1}]}", "no \"ts\"", NULL);
    E("{\"traceEvents\":[{\"ph\":\"X\",\"cat\":\"kernel\",\"ts\":1,\"dur\":1}]}", "no \"name\"", NULL);
    E("{\"traceEvents\":[{\"ph\":\"X\",\"cat\":\"kernel\",\"name\":\"k\",\"ts\":1,\"dur\":-2}]}", "negative", NULL);
    E("{\"traceEvents\":[{\"ph\":\"X\",\"cat\":5,\"name\":\"k\",\"ts\":1,\"dur\":1}]}", "\"cat\" is not a string", NULL);
    E("{\"traceEvents\":[{\"ph\":\"X\",\"cat\":\"user_annotation\",\"name\":\"ProfilerStep#1\",\"ts\":1}]}", "no \"dur\"", NULL);
    /* JSON syntax */
    E("{\"traceEvents\":[{\"a\":1,}]}", "expected a string key", "byte 23");
    E("{\"traceEvents\":[{\"a\" 1}]}", "expected ':'", "byte 21");
    /* a missing ':' after a key, in every kind of object the reader walks */
    E("{\"traceEvents\" []}", "expected ':'", "byte 15");                             /* top level */
    E("{\"traceEvents\":[{\"args\":{\"x\" 1}}]}", "expected ':'", "byte 29");        /* event args */
    E("{\"distributedInfo\":{\"rank\" 0},\"traceEvents\":[]}", "expected ':'", "byte 27"); /* distributedInfo */
    E("{\"x\":{\"y\" 1},\"traceEvents\":[]}", "expected ':'", "byte 10");             /* skipped value, first key */
    E("{\"x\":{\"y\":1,\"z\" 2},\"traceEvents\":[]}", "expected ':'", "byte 16");      /* skipped value, later key */
    /* the input ends right after a key */
    E("{\"traceEvents\":[{\"ph\"", "end of input", NULL);
    E("{\"x\":{\"y\"", "end of input", NULL);
    E("{\"traceEvents\":[{\"a\":01}]}", "expected ',' or '}'", NULL);
    E("{\"traceEvents\":[{\"a\":\"x\ty\"}]}", "control character", "byte 23");
    E("{\"traceEvents\":[{\"a\":\"\\q\"}]}", "invalid escape", NULL);
    E("{\"traceEvents\":[{\"a\":\"\\u12G4\"}]}", "\\u escape", NULL);
    E("{\"traceEvents\":[{\"a\":\"\xff\"}]}", "UTF-8", "byte 22");
    E("{\"traceEvents\":[{\"a\":\"\xc0\xaf\"}]}", "UTF-8", NULL);
    E("{\"traceEvents\":[{\"a\":tru}]}", "expected a JSON value", NULL);
    E("{\"traceEvents\":[{\"a\":[1,2}]}", "expected ',' or ']'", NULL);
    E("{\"traceEvents\":[{\"a\":1.}]}", "digit expected", NULL);
    E("{\"traceEvents\":[{\"a\":-}]}", "invalid number", NULL);
    /* nesting deeper than the limit */
    size_t depth = 600;
    char *deep = malloc(40 + 2 * depth);
    strcpy(deep, "{\"traceEvents\":[{\"a\":");
    size_t o = strlen(deep);
    for (size_t i = 0; i < depth; i++) deep[o++] = '[';
    for (size_t i = 0; i < depth; i++) deep[o++] = ']';
    strcpy(deep + o, "}]}");
    expect_error(deep, strlen(deep), "nesting", NULL);
    free(deep);
#undef E
}

static void test_files_ranks_and_outputs(void **state) {
    (void)state;
    char dir[64];
    fm_test_tmpdir(dir, sizeof dir, "test_trace");
    char cmd[2048];
    char p0[400], p1[400], p0e[400];
    snprintf(p0, sizeof p0, "%s/1700-TP-0-DECODE.trace.json", dir);
    snprintf(p1, sizeof p1, "%s/1700-TP-1-DECODE.trace.json", dir);
    snprintf(p0e, sizeof p0e, "%s/1700-TP-0-EXTEND.trace.json", dir);
    const char *paths[3] = {p0, p1, p0e};
    for (int i = 0; i < 3; i++) {
        FILE *f = fopen(paths[i], "wb");
        assert_non_null(f);
        fputs(i == 1 ? k_profsteps : k_basic, f);
        fclose(f);
    }
    fm_trace *t = NULL;
    fm_trace_options o = {0};
    o.jobs = 2;
    assert_int_equal(fm_trace_open(paths, 3, &o, &t), FM_OK);
    assert_int_equal(fm_trace_rank_count(t), 2);
    assert_string_equal(fm_trace_rank_label(t, 0), "rank 0");
    assert_string_equal(fm_trace_rank_label(t, 1), "rank 1");
    /* rank 0 holds two files: 8 fused_moe_kernel; all ranks: 8 + 3 */
    assert_int_equal(kernel(t, 0, "fused_moe_kernel")->count, 8);
    assert_int_equal(kernel(t, 1, "fused_moe_kernel")->count, 3);
    assert_int_equal(kernel(t, -1, "fused_moe_kernel")->count, 11);

    /* summary CSV: header and one row per kernel name */
    char *buf = NULL;
    size_t len = 0;
    FILE *m = open_memstream(&buf, &len);
    assert_int_equal(fm_trace_write_summary(t, FM_TRACE_CSV, m), FM_OK);
    fclose(m);
    assert_non_null(strstr(buf, "name,category,count,total_us,mean_us,p50_us,p90_us,p99_us,max_us\n"));
    assert_int_equal(strncmp(buf, "name,", 5), 0);
    assert_non_null(strstr(buf, "\nfused_moe_kernel,moe_gemm,11,"));
    assert_non_null(strstr(buf, "\nMemcpy HtoD (Pinned -> Device),memory,2,10.000,5.000,"));
    free(buf);
    /* the other formats render */
    for (int f = FM_TRACE_TEXT; f <= FM_TRACE_HTML; f++) {
        buf = NULL;
        m = open_memstream(&buf, &len);
        assert_int_equal(fm_trace_write_summary(t, (fm_trace_format)f, m), FM_OK);
        fclose(m);
        assert_true(len > 100);
        if (f == FM_TRACE_HTML) {
            assert_non_null(strstr(buf, "<svg"));
            assert_null(strstr(buf, "src="));   /* self-contained: nothing fetched */
            assert_null(strstr(buf, "<link"));
        }
        free(buf);
    }
    fm_trace_free(t);

    /* diff CSV: A = k_basic (one whole-trace step), B = k_profsteps (2 steps) */
    fm_trace *a = open_doc(k_basic, NULL), *b = open_doc(k_profsteps, NULL);
    buf = NULL;
    m = open_memstream(&buf, &len);
    assert_int_equal(fm_trace_write_diff(a, b, FM_TRACE_CSV, m), FM_OK);
    fclose(m);
    /* A: moe 0.101, memory 0.005 (total 0.106); B: moe 0.025, comm 0.010,
     * attention 0.025 (total 0.060). delta total -0.046 */
    const char *hdr = "category,a_ms_per_step,b_ms_per_step,delta_ms,share_of_delta\n";
    assert_int_equal(strncmp(buf, hdr, strlen(hdr)), 0);
    assert_non_null(strstr(buf, "\nattention,0.0000,0.0250,0.0250,-0.5435\n"));
    assert_non_null(strstr(buf, "\nmoe_gemm,0.1010,0.0250,-0.0760,1.6522\n"));
    assert_non_null(strstr(buf, "\ncomm,0.0000,0.0100,0.0100,-0.2174\n"));
    assert_non_null(strstr(buf, "\nmemory,0.0050,0.0000,-0.0050,0.1087\n"));
    assert_non_null(strstr(buf, "\ntotal,0.1060,0.0600,-0.0460,1.0000\n"));
    free(buf);
    buf = NULL;
    m = open_memstream(&buf, &len);
    assert_int_equal(fm_trace_write_diff(a, b, FM_TRACE_TEXT, m), FM_OK);
    fclose(m);
    assert_non_null(strstr(buf, "kernels that explain the delta"));
    free(buf);
    fm_trace_free(a);
    fm_trace_free(b);

    /* a missing file and a truncated gzip file name the file */
    const char *missing[1] = {"/nonexistent/x.json.gz"};
    assert_int_equal(fm_trace_open(missing, 1, NULL, &t), FM_E_IO);
    char gz[600];
    snprintf(gz, sizeof gz, "%s/t.json.gz", dir);
    snprintf(cmd, sizeof cmd, "gzip -c %s | head -c 120 > %s", p0, gz);
    assert_int_equal(system(cmd), 0);
    const char *gzp[1] = {gz};
    assert_int_not_equal(fm_trace_open(gzp, 1, NULL, &t), FM_OK);
    assert_non_null(strstr(fm_last_error(), "t.json.gz"));
    fm_test_rm_tree(dir);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_kernel_stats),
        cmocka_unit_test(test_categories),
        cmocka_unit_test(test_user_rules),
        cmocka_unit_test(test_steps_correlation),
        cmocka_unit_test(test_steps_gpu_and_sglang),
        cmocka_unit_test(test_steps_graph_streams),
        cmocka_unit_test(test_steps_marker),
        cmocka_unit_test(test_begin_end_and_escapes),
        cmocka_unit_test(test_chunk_boundaries),
        cmocka_unit_test(test_every_prefix_fails),
        cmocka_unit_test(test_malformed),
        cmocka_unit_test(test_files_ranks_and_outputs),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
