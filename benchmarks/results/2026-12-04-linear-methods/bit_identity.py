"""The session's exactness check (the same steps as it ran, tidied).

``python bit_identity.py TREE OUT.pt`` loads the bundled model from the source tree TREE in fp32 and bf16 with
``--quantization none``, ``int4`` and ``int8``, runs a 40-token prefill and six one-call decode steps through
a paged cache, and saves the prefill's last logits, the last decode step's logits and the greedy tokens.
``python bit_identity.py --compare A.pt B.pt`` then says, per case, whether both trees gave equal tensors.
"""

from __future__ import annotations

import sys

MODEL = "/root/.cache/tandem/models/SmolLM2-135M-Instruct"  # `tandem model prepare`'s converted directory


def run(tree: str, out_path: str) -> None:
    sys.path.insert(0, tree)
    import torch

    from common.attention.metadata import AttentionMetadata
    from common.kv.kv_cache import KVCache, KVCacheSpec
    from common.model.loader import load_model

    out = {}
    for quantization in ("none", "int4", "int8"):
        for dtype in ("float32", "bfloat16"):
            model = load_model(MODEL, dtype=dtype, quantization=quantization)
            c = model.config
            cache = KVCache(KVCacheSpec(c.num_layers, c.num_kv_heads, c.head_dim, 16, dtype), 64)
            with torch.no_grad():
                meta = AttentionMetadata.build([40], [0], [list(range(3))], 16)
                hidden = model(torch.arange(5, 45), torch.arange(40), meta, cache)
                prefill_logits = model.compute_logits(hidden[-1:])
                token, pos, tokens = int(prefill_logits.argmax()), 40, []
                for _ in range(6):  # decode steps: the one-call step where it applies
                    meta = AttentionMetadata.build([1], [pos], [list(range(3))], 16)
                    decode_logits = model.compute_logits(model(torch.tensor([token]), torch.tensor([pos]), meta, cache))
                    token, pos = int(decode_logits.argmax()), pos + 1
                    tokens.append(token)
            out[f"{quantization}-{dtype}"] = (prefill_logits, decode_logits, tokens)
            print(quantization, dtype, tokens, model.weight_bytes, type(model.embed_tokens).__name__)
    torch.save(out, out_path)


def compare(a_path: str, b_path: str) -> None:
    import torch

    a, b = torch.load(a_path, weights_only=False), torch.load(b_path, weights_only=False)
    for case in a:
        same = [torch.equal(a[case][0], b[case][0]), torch.equal(a[case][1], b[case][1]), a[case][2] == b[case][2]]
        print(case, "prefill logits", same[0], "decode logits", same[1], "tokens", same[2])


if __name__ == "__main__":
    if sys.argv[1] == "--compare":
        compare(sys.argv[2], sys.argv[3])
    else:
        run(sys.argv[1], sys.argv[2])
