/* kernels.cuh — the launchers of the device kernels (kernels_ref.cu: the reference kernels, one thread per
 * output with plain loops, sums in double; kernels_fast.cu: the fast ones). Each queues its kernel on `stream`
 * and returns the launch's error. */
#pragma once
#include <type_traits>
#include <cuda_runtime.h>
#include "blocks.cuh"
#include "device.h"

namespace strata_cuda {

/* f(std::integral_constant<int, T>{}) for the weight type T = `type` of the products (each launcher's template
 * instantiated once per type, in one place); an unknown type is an invalid value. */
template <typename F> cudaError_t by_type(int type, F &&f) {
    switch (type) {
    case STRATA_TYPE_F32: return f(std::integral_constant<int, STRATA_TYPE_F32>{});
    case STRATA_TYPE_F16: return f(std::integral_constant<int, STRATA_TYPE_F16>{});
    case STRATA_TYPE_BF16: return f(std::integral_constant<int, STRATA_TYPE_BF16>{});
    case STRATA_TYPE_Q8_0: return f(std::integral_constant<int, STRATA_TYPE_Q8_0>{});
    case STRATA_TYPE_Q4_K: return f(std::integral_constant<int, STRATA_TYPE_Q4_K>{});
    case STRATA_TYPE_Q5_K: return f(std::integral_constant<int, STRATA_TYPE_Q5_K>{});
    case STRATA_TYPE_Q6_K: return f(std::integral_constant<int, STRATA_TYPE_Q6_K>{});
    case STRATA_TYPE_IQ4_XS: return f(std::integral_constant<int, STRATA_TYPE_IQ4_XS>{});
    case STRATA_TYPE_MXFP4: return f(std::integral_constant<int, STRATA_TYPE_MXFP4>{});
    default: return cudaErrorInvalidValue;
    }
}

cudaError_t matmul_ref(const strata_dev_matmul_args *a, cudaStream_t stream);
/* Tokens of the delta rule's chunks in its chunked form (blocks_deltanet.c's CHUNK). */
constexpr int DELTA_CHUNK = 64;

cudaError_t rms_norm_ref(const strata_dev_rms_norm_args *a, cudaStream_t stream);
cudaError_t rope_ref(const strata_dev_rope_args *a, cudaStream_t stream);
cudaError_t attention_ref(const strata_dev_attention_args *a, cudaStream_t stream);
cudaError_t swiglu_ref(const strata_dev_swiglu_args *a, cudaStream_t stream);
cudaError_t topk_ref(const strata_dev_topk_args *a, cudaStream_t stream);
cudaError_t add_rows_ref(const strata_dev_add_rows_args *a, cudaStream_t stream);
cudaError_t kv_store_ref(const strata_dev_kv_store_args *a, cudaStream_t stream);
cudaError_t dn_conv_ref(const strata_dev_dn_conv_args *a, cudaStream_t stream);
cudaError_t l2_norm_ref(const strata_dev_l2_norm_args *a, cudaStream_t stream);
cudaError_t dn_gates_ref(const strata_dev_dn_gates_args *a, cudaStream_t stream);
cudaError_t delta_rule_ref(const strata_dev_delta_rule_args *a, cudaStream_t stream);
cudaError_t delta_rule_chunked_ref(const strata_dev_delta_rule_args *a, cudaStream_t stream);
cudaError_t gated_rms_norm_ref(const strata_dev_gated_rms_norm_args *a, cudaStream_t stream);

/* Bytes of scratch matmul needs (its activations quantised; 0 for F32, F16 and BF16 weights). */
size_t matmul_scratch_bytes(const strata_dev_matmul_args *a);
cudaError_t matmul(const strata_dev_matmul_args *a, void *scratch, cudaStream_t stream);
cudaError_t rms_norm(const strata_dev_rms_norm_args *a, cudaStream_t stream);
cudaError_t rope(const strata_dev_rope_args *a, cudaStream_t stream);
cudaError_t attention(const strata_dev_attention_args *a, cudaStream_t stream);
cudaError_t swiglu(const strata_dev_swiglu_args *a, cudaStream_t stream);
cudaError_t topk(const strata_dev_topk_args *a, cudaStream_t stream);
cudaError_t add_rows(const strata_dev_add_rows_args *a, cudaStream_t stream);
cudaError_t kv_store(const strata_dev_kv_store_args *a, cudaStream_t stream);
cudaError_t dn_conv(const strata_dev_dn_conv_args *a, cudaStream_t stream);
cudaError_t l2_norm(const strata_dev_l2_norm_args *a, cudaStream_t stream);
cudaError_t dn_gates(const strata_dev_dn_gates_args *a, cudaStream_t stream);
cudaError_t delta_rule(const strata_dev_delta_rule_args *a, cudaStream_t stream);
cudaError_t delta_rule_chunked(const strata_dev_delta_rule_args *a, cudaStream_t stream);
cudaError_t gated_rms_norm(const strata_dev_gated_rms_norm_args *a, cudaStream_t stream);

cudaError_t sigmoid_gate_ref(const strata_dev_sigmoid_gate_args *a, cudaStream_t stream);
cudaError_t sigmoid_gate(const strata_dev_sigmoid_gate_args *a, cudaStream_t stream);
// a vision encoder's pieces
cudaError_t layer_norm_ref(const strata_dev_layer_norm_args *a, cudaStream_t stream);
cudaError_t gelu_ref(const strata_dev_gelu_args *a, cudaStream_t stream);
cudaError_t vit_attention_ref(const strata_dev_vit_attention_args *a, cudaStream_t stream);
cudaError_t layer_norm(const strata_dev_layer_norm_args *a, cudaStream_t stream);
cudaError_t gelu(const strata_dev_gelu_args *a, cudaStream_t stream);
cudaError_t vit_attention(const strata_dev_vit_attention_args *a, cudaStream_t stream);
// a layer's routed experts in one launch each (moe_matmul's scratch: its activations quantised, as matmul's)
cudaError_t moe_group_ref(const strata_dev_moe_group_args *a, cudaStream_t stream);
cudaError_t moe_matmul_ref(const strata_dev_moe_matmul_args *a, cudaStream_t stream);
cudaError_t moe_group(const strata_dev_moe_group_args *a, cudaStream_t stream);
size_t moe_matmul_scratch_bytes(const strata_dev_moe_matmul_args *a);
cudaError_t moe_matmul(const strata_dev_moe_matmul_args *a, void *scratch, cudaStream_t stream);

}  // namespace strata_cuda
