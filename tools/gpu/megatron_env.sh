# shellcheck shell=bash disable=SC2034  # FILES is read by the scripts that source this
# Sourced by the Megatron-LM scripts here (megatron_cold.sh, megatron_floor.sh, warm_wall.sh,
# megatron_profile.sh): the 281 tests' paths (the staged run.sh's selection) and the
# variables every run of them sets (multicast off; the conftest's data download failing at
# once: this host reaches no network).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HTTPS_PROXY=http://127.0.0.1:9 HTTP_PROXY=http://127.0.0.1:9 \
  https_proxy=http://127.0.0.1:9 http_proxy=http://127.0.0.1:9
FILES=(tests/unit_tests/test_parallel_state.py tests/unit_tests/tensor_parallel
  tests/unit_tests/distributed/test_param_and_grad_buffer.py tests/unit_tests/transformer/test_mlp.py
  tests/unit_tests/transformer/test_module.py tests/unit_tests/transformer/test_rope.py
  tests/unit_tests/transformer/test_relative_attention.py tests/unit_tests/transformer/test_spec_utils.py
  tests/unit_tests/fusions/test_torch_softmax.py tests/unit_tests/models/test_base_embedding.py
  tests/unit_tests/models/test_multimodal_projector.py)
