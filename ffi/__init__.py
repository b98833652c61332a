"""The custom-call layer of jax-kda: the top-level folder ffi/, installed as `jax_kda.ffi`
(pyproject.toml's package-dir). The fused CuTe DSL kernel under JAX (`cutedsl_verify`
in verify_call.py, a custom call with the cache aliased in place), on any DLPack arrays
(`eager_verify`, eager.py), the prefill's convolution, chunk operands and scan over
chunks (`cutedsl_prompt_conv`, `cutedsl_chunk_operands`, `cutedsl_chunk_states`,
prefill_calls.py), how a batch is launched (`kernel_split`, `solo_ctas`, launch.py),
and how the calls are compiled and emitted (lowering.py, the one module on CuTe DSL's
private JAX internals). Importing it needs nvidia-cutlass-dsl only when a kernel is
called."""
from jax_kda.ffi.eager import eager_verify
from jax_kda.ffi.launch import choose_split, kernel_split, sm_count, solo_ctas
from jax_kda.ffi.prefill_calls import (cutedsl_chunk_operands, cutedsl_chunk_states,
                                       cutedsl_prompt_conv)
from jax_kda.ffi.verify_call import cutedsl_verify

__all__ = ["choose_split", "cutedsl_chunk_operands", "cutedsl_chunk_states",
           "cutedsl_prompt_conv", "cutedsl_verify", "eager_verify", "kernel_split", "sm_count",
           "solo_ctas"]
