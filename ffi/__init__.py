"""The custom-call layer of jax-kda (installed as `jax_kda.ffi`): the fused CuTe DSL
kernel under JAX (`cutedsl_verify`, a cutlass_call with the cache aliased in place) and
on any DLPack arrays (`eager_verify`). Importing it needs nvidia-cutlass-dsl only when
one of them is called."""
from jax_kda.ffi.call import choose_split, cutedsl_verify, kernel_split, solo_ctas
from jax_kda.ffi.eager import eager_verify

__all__ = ["choose_split", "cutedsl_verify", "eager_verify", "kernel_split", "solo_ctas"]
