/* kernels.cuh — the launchers of the device kernels (kernels_ref.cu: the reference kernels, one thread per
 * output with plain loops, sums in double; kernels_fast.cu: the fast ones). Each queues its kernel on `stream`
 * and returns the launch's error. */
#pragma once
#include <cuda_runtime.h>
#include "blocks.cuh"
#include "device.h"

namespace strata_cuda {

cudaError_t matmul_ref(const strata_dev_matmul_args *a, cudaStream_t stream);
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

}  // namespace strata_cuda
