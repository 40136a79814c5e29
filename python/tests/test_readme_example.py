"""The README's Python example, run exactly as shown, then checked against the oracle."""

from __future__ import annotations

import contextlib
import io

import numpy as np

from attention_oracle import TOLERANCE, attend, rel_err

README_EXAMPLE = '''\
import numpy as np
import pagedattn

layer = pagedattn.Attention(num_heads=8, head_size=64, scale=0.125, num_kv_heads=2, dtype="float32")
kv_cache = layer.allocate_kv_cache(num_blocks=8)    # (2, 8, 16, 2, 64) NumPy array, zeroed
# One step: request 0 prefills 5 tokens; request 1 decodes its 21st token (20 cached).
common = pagedattn.CommonAttentionMetadata(
    query_start_loc=[0, 5, 6], seq_lens=[5, 21], block_table=[[0, 1], [2, 3]],
    slot_mapping=[0, 1, 2, 3, 4, 3 * 16 + 4])       # slot = block * block_size + offset
attn_metadata = layer.metadata_builder().build(common)
rng = np.random.default_rng(0)
q = rng.standard_normal((6, 8, 64), dtype=np.float32)
k, v = rng.standard_normal((2, 6, 2, 64), dtype=np.float32)
out, lse = layer.forward(q, k, v, kv_cache, attn_metadata, return_lse=True)
print(layer.backend.name, out.shape, lse.shape)     # e.g. CPU (6, 8, 64) (8, 6)
'''


def test_readme_example_runs_as_shown():
    namespace: dict = {}
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        exec(compile(README_EXAMPLE, "README.md", "exec"), namespace)
    backend = namespace["layer"].backend.name
    assert stdout.getvalue() == f"{backend} (6, 8, 64) (8, 6)\n"

    # What it computed: request 0 attends causally over its 5 new tokens; request 1's query
    # at position 20 attends over 20 zero keys (fresh cache) and its own new key.
    q, k, v, out = (namespace[n].astype(np.float64) for n in ("q", "k", "v", "out"))
    scale = 64 ** -0.5
    o0, l0 = attend(q[:5], k[:5], v[:5], np.arange(5), np.arange(5), scale)
    k1 = np.concatenate([np.zeros((20, 2, 64)), k[5:]])
    v1 = np.concatenate([np.zeros((20, 2, 64)), v[5:]])
    o1, l1 = attend(q[5:], k1, v1, np.array([20]), np.arange(21), scale)
    assert rel_err(out, np.concatenate([o0, o1])) <= TOLERANCE["float32"]
    assert rel_err(namespace["lse"], np.concatenate([l0, l1], axis=1)) <= 1e-5
