"""What `import jax_kda` gives a user, checked in a fresh interpreter (the test session
has imported every submodule already)."""
import os
import subprocess
import sys


def test_import_reaches_the_references():
    code = ("import jax_kda; "
            "print(jax_kda.ref.stock_verify.__name__, jax_kda.ref.stock_prefill.__name__)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=dict(os.environ, JAX_PLATFORMS="cpu"), check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["stock_verify", "stock_prefill"]
