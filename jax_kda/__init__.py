"""jax-kda: the speculative-decoding verify of Kimi Delta Attention with a deferred
replay commit, for JAX; a fused CuTe DSL kernel on Hopper, XLA elsewhere."""
from jax_kda.backends import BACKENDS, cutedsl_supported
from jax_kda.checkpoints import convert_layer
from jax_kda.commit import accept, flush
from jax_kda.compile_cache import compile_kernels, enable_compile_cache
from jax_kda.config import K, KdaConfig
from jax_kda.prefill import prefill
from jax_kda.projections import KdaProjections, layer_inputs, layer_output
from jax_kda.pytrees import (AWAITING, KdaCache, KdaParams, PrefillInputs, VerifyInputs,
                             cache_shapes, init_cache)
from jax_kda.sharding import head_specs, local_config, output_spec
from jax_kda.validate import check_inputs
from jax_kda.verify import fused_verify
from jax_kda import ref  # the references, reachable as jax_kda.ref after `import jax_kda`

__all__ = [
    "AWAITING", "BACKENDS", "K", "KdaCache", "KdaConfig", "KdaParams", "KdaProjections",
    "PrefillInputs", "VerifyInputs", "accept", "cache_shapes", "check_inputs",
    "compile_kernels", "convert_layer", "cutedsl_supported", "enable_compile_cache", "flush",
    "fused_verify", "head_specs", "init_cache", "layer_inputs", "layer_output",
    "local_config", "output_spec", "prefill", "ref",
]
