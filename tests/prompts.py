"""Random prompt batches for the prefill's tests."""
import jax.numpy as jnp
import numpy as np

from jax_kda import PrefillInputs


def random_prompts(rng, config, lengths, slots, record_rows, width):
    """PrefillInputs of random tokens, [B, width, ...], NaN past each prompt's length
    (padding that must reach nothing)."""
    B, H = len(slots), config.heads
    lengths = np.asarray(lengths, np.int32)

    def bf16(*shape):
        past = np.arange(width)[None, :] >= lengths[:, None]
        values = rng.standard_normal((B, width) + shape)
        values[past] = np.nan
        return jnp.asarray(values, jnp.bfloat16)

    return PrefillInputs(x=bf16(3, H, 128), f_a=bf16(128), beta=bf16(H), gate=bf16(H, 128),
                         lengths=jnp.asarray(lengths), slots=jnp.asarray(slots, jnp.int32),
                         record_rows=jnp.asarray(record_rows, jnp.int32))
