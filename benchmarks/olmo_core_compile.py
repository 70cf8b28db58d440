"""CPU compile time of OLMo-core's per-block ``torch.compile`` of our scheme blocks.

One fresh process per measurement (an empty Inductor cache of its own): a SchemeTransformer is
built (dim 64, 4 heads, QK-norm, untied, ``--blocks`` blocks), runs one eager forward (which
fills OLMo-core's RoPE cache: dynamo guards on it), ``apply_compile`` runs, and the first training
step (forward and backward: dynamo, AOTAutograd and Inductor) is timed, then two more (compiled
already). Prints one JSON line: the scheme, the step times, dynamo's unique
graphs and its frame count, Inductor's FX graph cache hits and misses.

    OMP_NUM_THREADS=1 python benchmarks/olmo_core_compile.py --scheme siamese --blocks 12

docs/performance.md (issue 34) compares the per-block compile before and after the block views
by running this for both trees in turn (``PYTHONPATH=<tree>/src``), medians of 3.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scheme", default="pre")
    parser.add_argument("--form", default=None, help="SiameseNorm's form (post_pre, hybrid_pre)")
    parser.add_argument("--blocks", type=int, default=12)
    args = parser.parse_args()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-")

    import torch
    import torch._dynamo as dynamo
    from torch._dynamo.utils import counters

    from siamesenorm.models import LMConfig
    from siamesenorm.olmo_core import olmo_config

    options = {"form": args.form} if args.form else {}
    cfg = LMConfig(vocab_size=256, dim=64, n_layers=args.blocks, n_heads=4, max_seq_len=64,
                   qk_norm=True, tie_embeddings=False, scheme=args.scheme, scheme_options=options)
    torch.manual_seed(0)
    model = olmo_config(cfg).build()
    ids = torch.randint(0, 256, (4, 65))
    x, y = ids[:, :-1], ids[:, 1:]
    with torch.no_grad():       # fills OLMo-core's RoPE buffer cache, which dynamo guards on
        eager_loss = float(model(x, labels=y).loss)
    model.apply_compile()
    times, losses = [], []
    for _ in range(3):
        start = time.perf_counter()
        loss = model(x, labels=y).loss
        loss.backward()
        times.append(time.perf_counter() - start)
        losses.append(float(loss))
    print(json.dumps({"scheme": args.scheme + (f"-{args.form}" if args.form else ""),
                      "blocks": args.blocks, "first_step_s": round(times[0], 2),
                      "later_steps_s": [round(t, 4) for t in times[1:]],
                      "compiled_minus_eager_loss": losses[0] - eager_loss,
                      "graphs": counters["stats"]["unique_graphs"],
                      "frames": counters["frames"]["ok"],
                      "fx_graph_cache": {k: v for k, v in counters["inductor"].items()
                                         if k.startswith("fxgraph_cache")},
                      "dynamo_limit": dynamo.config.recompile_limit,
                      "siamesenorm": __import__("siamesenorm").__file__}))


if __name__ == "__main__":
    main()
