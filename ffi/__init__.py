"""The custom-call layer of jax-kda (installed as `jax_kda.ffi`): the fused CuTe DSL
kernel under JAX (`cutedsl_verify`, a custom call with the cache aliased in place), on
any DLPack arrays (`eager_verify`), the prefill's convolution, chunk operands and scan
over chunks (`cutedsl_prompt_conv`, `cutedsl_chunk_operands`, `cutedsl_chunk_states`),
and how a batch is launched (`kernel_split`, `solo_ctas`). Importing it needs
nvidia-cutlass-dsl only when a kernel is called."""
from jax_kda.ffi.call import cutedsl_verify
from jax_kda.ffi.chunks import (cutedsl_chunk_operands, cutedsl_chunk_states,
                                cutedsl_prompt_conv)
from jax_kda.ffi.eager import eager_verify
from jax_kda.ffi.launch import choose_split, kernel_split, sm_count, solo_ctas

__all__ = ["choose_split", "cutedsl_chunk_operands", "cutedsl_chunk_states",
           "cutedsl_prompt_conv", "cutedsl_verify", "eager_verify", "kernel_split", "sm_count",
           "solo_ctas"]
