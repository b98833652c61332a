"""The pointwise pieces of jax_kda.layer against the float64 NumPy model: the gate
projection in each gate_mode, bit for bit on inputs built to sit on bf16 rounding ties
where the two modes' summation orders round apart (gate_ties.py), and on random ones.
Its chains are additions written out in order, so this holds on any CPU."""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import numpy_model
from compare import bits
from gate_ties import tie_f_a, tie_f_b
from jax_kda.layer import gate_projection

B, T, H = 2, 3, 2
project = jax.jit(gate_projection, static_argnums=2)


def model_projection(f_a, f_b, gate_mode):
    """numpy_model.gate_projection per (request, token, head): [B, T, H, K] float64."""
    f_a, f_b = np.asarray(f_a), np.asarray(f_b)
    return np.array([[[numpy_model.gate_projection(f_a[b, t], f_b[h], gate_mode)
                       for h in range(f_b.shape[0])] for t in range(f_a.shape[1])]
                     for b in range(f_a.shape[0])])


@functools.cache
def tie_inputs(seed=7):
    """Every feature row designed (gate_ties.py): the modes differ in every raw gate."""
    rng = np.random.default_rng(seed)
    return tie_f_a(rng, (B, T)), tie_f_b(rng, H, designed=slice(None))


def test_gate_modes_differ_on_the_designed_rows():
    # the premise of the test below: the two summation orders give different raw gates
    # in every designed feature row, the model rounding as gate_ties.py derives
    f_a, f_b = tie_inputs()
    mode0, mode1 = model_projection(f_a, f_b, 0), model_projection(f_a, f_b, 1)
    assert np.all(mode0 != mode1)
    assert np.all(np.abs(mode1) > np.abs(mode0))  # mode 1 is above the tie: rounded away


@pytest.mark.parametrize("gate_mode", [0, 1], ids=["gate_mode0", "gate_mode1"])
def test_gate_projection_is_bit_exact(gate_mode):
    f_a, f_b = tie_inputs()
    actual = np.asarray(project(f_a, f_b, gate_mode), np.float32)
    expected = model_projection(f_a, f_b, gate_mode).astype(np.float32)
    np.testing.assert_array_equal(bits(actual), bits(expected))
    # and the other mode's result is not what this mode gave (a mode-blind projection
    # fails one of the two parametrizations)
    other = model_projection(f_a, f_b, 1 - gate_mode).astype(np.float32)
    assert np.all(bits(actual) != bits(other))


@pytest.mark.parametrize("gate_mode", [0, 1], ids=["gate_mode0", "gate_mode1"])
def test_gate_projection_on_random_inputs(gate_mode):
    # the chains are written out in order, so every bf16 rounding is the model's
    rng = np.random.default_rng(8 + gate_mode)
    f_a = jnp.asarray(rng.standard_normal((B, 8, 128)), jnp.bfloat16)
    f_b = jnp.asarray(rng.standard_normal((H, 128, 128)) * 128**-0.5, jnp.bfloat16)
    actual = np.asarray(project(f_a, f_b, gate_mode), np.float32)
    expected = model_projection(f_a, f_b, gate_mode).astype(np.float32)
    np.testing.assert_array_equal(bits(actual), bits(expected))


@pytest.mark.parametrize("gate_mode", [0, 1], ids=["gate_mode0", "gate_mode1"])
def test_gate_projection_is_no_dot(gate_mode):
    """No dot in the projection's program, before or after XLA's passes: a dot's
    summation order is the platform's (the designed ties above caught XLA:CPU summing a
    chain as four on some CPUs), additions written out are not reordered."""
    f_a, f_b = tie_inputs()
    lowered = project.lower(f_a, f_b, gate_mode)
    assert "dot_general" not in lowered.as_text()
    assert not re.search(r"\bdot\(|custom-call", lowered.compile().as_text())
