"""``import dspark_core`` loads no heavy optional module; bfloat16 loads when first used.

Each check runs in a fresh interpreter (``sys.modules`` of this one already
holds everything the other tests imported). No timing is asserted here:
bench/bench_import.py measures the CPU time against ``import numpy``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

# Modules `import dspark_core` must not load: ml_dtypes (bfloat16: several times numpy's
# own import), gguf-py (drafter metadata reads it when a GGUF is opened), importlib.abc
# (pulls in importlib.resources, pathlib's friends, tempfile, inspect).
HEAVY = ("ml_dtypes", "gguf", "importlib.abc", "matplotlib", "llama_cpp")


def run(code: str) -> dict:
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_import_loads_no_heavy_module():
    out = run(f"""
        import json, sys
        import dspark_core
        print(json.dumps({{m: m in sys.modules for m in {HEAVY!r}}}))
    """)
    assert out == dict.fromkeys(HEAVY, False)


def test_bfloat16_loads_on_first_use_and_round_trips():
    out = run("""
        import json, sys
        import numpy as np
        import dspark_core
        from dspark_core import Stager, StagerConfig, dequantize_rows, quantize_rows
        res = {"before": "ml_dtypes" in sys.modules}
        x = np.array([[1.0, -2.5, 3.0e38, 1.0e-40] * 8], dtype=np.float32)
        # f32 and f16 work without loading it.
        quantize_rows(x[:, :2].astype(np.float16), "f16")
        dequantize_rows(quantize_rows(x[:, :2].repeat(16, axis=1), "q8_0"), "q8_0", 32)
        res["after_f32_f16"] = "ml_dtypes" in sys.modules
        # A bfloat16 output by name loads it.
        b = dequantize_rows(quantize_rows(x, "bf16"), "bf16", 32, out_dtype="bfloat16")
        res["dtype"] = str(b.dtype)
        res["after_bf16"] = "ml_dtypes" in sys.modules
        import ml_dtypes
        ref = x.astype(ml_dtypes.bfloat16)
        res["equal"] = bool((b.view(np.uint16) == ref.view(np.uint16)).all())
        # bfloat16 input rows, and a Stager staging bfloat16.
        q = quantize_rows(ref, "bf16")
        res["bf16_in"] = bool((q.view(np.uint16) == ref.view(np.uint16)).all())
        st = Stager(StagerConfig(feature_dim=32, block_size=2, window=16, max_seqs=1, stage_dtype="bfloat16"))
        st.begin(0)
        st.process(0, np.arange(4), np.repeat(ref, 4, axis=0))
        plan = st.draft(0, 4)
        res["stage_dtype"] = str(plan.rows.dtype)
        res["staged_equal"] = bool((plan.rows.view(np.uint16) == ref.view(np.uint16)).all())
        print(json.dumps(res))
    """)
    assert out == {"before": False, "after_f32_f16": False, "dtype": "bfloat16", "after_bf16": True,
                   "equal": True, "bf16_in": True, "stage_dtype": "bfloat16", "staged_equal": True}


def test_bfloat16_user_array_before_any_dspark_bf16_call():
    # The user's code imports ml_dtypes first and hands in bfloat16 rows: recognised as such.
    out = run("""
        import json
        import ml_dtypes
        import numpy as np
        from dspark_core import formats
        x = np.arange(64, dtype=np.float32).reshape(2, 32).astype(ml_dtypes.bfloat16)
        q = formats.quantize_rows(x, "f32")  # exact: bfloat16 -> f32 -> bfloat16
        y = formats.dequantize_rows(q, "f32", 32, out_dtype=ml_dtypes.bfloat16)
        print(json.dumps({"dtype": str(y.dtype), "same": bool((y == x).all())}))
    """)
    assert out == {"dtype": "bfloat16", "same": True}


def test_unsupported_dtype_still_rejected_without_loading_bfloat16():
    out = run("""
        import json, sys
        import numpy as np
        from dspark_core import quantize_rows
        try:
            quantize_rows(np.zeros((1, 32), dtype=np.int32), "f32")
            err = None
        except TypeError as e:
            err = str(e)
        print(json.dumps({"err": err, "loaded": "ml_dtypes" in sys.modules}))
    """)
    assert out["err"] is not None and "not supported" in out["err"]
    assert out["loaded"] is False


def test_a_bf16_ring_owner_loads_bfloat16_when_made_not_in_its_first_write():
    """A server's first step must not pay for ml_dtypes (about a second under load): a HostRing
    of a bf16 Stager loads it when it is made; one of another storage does not."""
    out = run("""
        import json, sys
        from dspark_core import Stager, StagerConfig
        from dspark_core.rows.host_ring import HostRing
        res = {}
        f16 = Stager(StagerConfig(feature_dim=32, block_size=2, window=16, max_seqs=1, storage="f16", rows="external"))
        HostRing(f16)
        res["f16_ring"] = "ml_dtypes" in sys.modules
        bf16 = Stager(StagerConfig(feature_dim=32, block_size=2, window=16, max_seqs=1, storage="bf16", rows="external"))
        HostRing(bf16)
        res["bf16_ring"] = "ml_dtypes" in sys.modules
        print(json.dumps(res))
    """)
    assert out == {"f16_ring": False, "bf16_ring": True}
