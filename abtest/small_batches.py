import json
from dataclasses import replace
import pagedcli.backends.cuda as cb
from pagedcli.bench import Workload, measure_bandwidth, run_batch
from pagedcli.loader import EngineOptions, load_model
opts = EngineOptions(model="random:llama-3.2-1b", device="cuda", batch=8)
model = load_model(opts)
bw = measure_bandwidth(model.device)
work = Workload(input_len="128", output_len="256")
variants = {"default": {}, "cublas above 2 rows": {"GEMV_MAX_ROWS": 2}, "cublas above 1 row": {"GEMV_MAX_ROWS": 1},
            "no split-K": {"GEMV_SPLITS": (1,)}, "no clusters": {"ATTN_CLUSTER": 1}}
for name, v in variants.items():
    saved = {k: getattr(cb, k) for k in v}
    for k, x in v.items(): setattr(cb, k, x)
    out = []
    for b in (2, 3, 4, 8):
        r = run_batch(model, replace(opts, batch=b), b, work, bw)
        out.append(f"b{b} {r['decode_tokens_per_s']:.0f} ({r['decode_step_ms']:.3f} ms)")
    for k, x in saved.items(): setattr(cb, k, x)
    print(f"{name:22s}", "  ".join(out), flush=True)
