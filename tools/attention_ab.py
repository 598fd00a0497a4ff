"""The decode attention kernel alone and the decode step's graph replay, another revision's kernels
against this tree's, alternating in one process (one machine, one run):

    git archive REV kernels | tar -x -C /tmp/base && python3 tools/attention_ab.py /tmp/base/kernels
"""
import sys
from pathlib import Path
from dataclasses import replace
sys.path.insert(0, "tools")
import pagedcli.backends.cuda_compile as cc
from tune_decode import replay_ms
from pagedcli.bench.kernel import bench_decode_kernel
from pagedcli.model.loader import EngineOptions, load_model
tree = cc.kernel_folder()
FOLDERS = {"base": Path(sys.argv[1]).resolve(), "new": tree}
def use(name):
    cc.kernel_folder = lambda: FOLDERS[name]
    cc.compile_kernels.cache_clear()
opts = EngineOptions(model="random:llama-3.2-1b", device="cuda", batch=1)
model = load_model(opts)
for rnd in range(2):
    for name in ("base", "new") if rnd == 0 else ("new", "base"):
        use(name)
        rows = bench_decode_kernel([1, 64, 256], [164, 1024, 4096], max_model_len=131072)
        print(f"{rnd} {name:5s} alone us:", "  ".join(f"b{r['batch']}/{r['context']} {r['paged_ms']*1e3:6.2f}" for r in rows), flush=True)
        r = {b: replay_ms(model, replace(opts, batch=b)) for b in (1, 64, 256)}
        print(f"{rnd} {name:5s} step ms:", "  ".join(f"b{b} {t:.4f}" for b, t in r.items()), flush=True)
