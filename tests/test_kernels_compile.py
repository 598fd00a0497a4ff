"""Every CUDA kernel compiles, with nvcc, for every preset geometry and dtype, with a pool in the
model dtype and an fp8 pool, exactly as the CUDA backend would build it (cuda_build.plan_kernels:
the same files, kernels and -D defines; the builds run at once, one nvcc per core; a PTX build
defines every kernel the plan would load from it), and what the
plan sends to torch ops instead is what our kernels truly cannot serve. fp8.cuh's software float ->
e4m3 conversion (what GPUs before sm_89 run) is compiled into a host program and compared with
torch's cast.

No GPU needed: nvcc is on the developers' and CI's machines (skipped with a reason without it).
A geometry that fails here is one a user would have hit at run time.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import textwrap
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from pagedcli.backends.cuda_build import AttentionShape, plan_kernels
from pagedcli.backends.cuda_compile import COMPILE_OPTIONS, define_flags, kernel_folder
from pagedcli.model.config import ModelConfig
from pagedcli.core.geometry import CacheGeometry
from pagedcli.core.fp8 import FP8_DTYPE, to_fp8
from pagedcli.model.source import RANDOM_PRESETS

NVCC = shutil.which("nvcc")
pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc (the CUDA toolkit) is not on PATH")


def fast_ptx_options() -> tuple[str, ...]:
    """What a PTX build adds: it is there for our compile-time checks (static_assert, #error, the
    templates each geometry instantiates), which the front end runs whatever the optimization, and
    nvcc's device optimizer is most of its time (gemv.cu: 1.4 s of 1.7 s). `-Ofc=max` (CUDA 12.8+;
    an older nvcc builds as the backend does) cuts that; the cubin builds keep the full optimizer
    and ptxas."""
    if NVCC is None:
        return ()
    done = subprocess.run([NVCC, "--help"], capture_output=True, text=True)
    return ("-Ofc=max",) if "--Ofast-compile" in done.stdout else ()


FAST_PTX = fast_ptx_options()

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Shapes beyond the presets: head_dim 80, 96, 256; query heads per kv head 16, 7, 5 and 1.
SYNTHETIC = {"gqa16-d80": (32, 2, 80), "gqa7-d96": (14, 2, 96), "gqa5-d256": (20, 4, 256), "mha-d100": (32, 32, 100)}


def preset_configs() -> dict[str, ModelConfig]:
    return {name: ModelConfig.from_file(path) for name, path in RANDOM_PRESETS.items()}


def synthetic_config(heads: int, kv_heads: int, head_dim: int) -> ModelConfig:
    return ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "hidden_size": 1024,
                                  "intermediate_size": 2048, "num_hidden_layers": 2, "num_attention_heads": heads,
                                  "num_key_value_heads": kv_heads, "head_dim": head_dim, "vocab_size": 1000,
                                  "max_position_embeddings": 4096}, source="test")


def geometry(config: ModelConfig, dtype, block_size: int = 16, cache_dtype=None) -> CacheGeometry:
    return CacheGeometry.build(config, dtype, block_size, num_blocks=8 * config.num_layers, cache_dtype=cache_dtype)


@dataclass(frozen=True)
class Build:
    what: str  # the preset, dtype and pool a failure names
    file: str
    defines: tuple
    cubin: bool = True  # through ptxas to a binary, or only to PTX
    arch: str = "sm_90"
    names: tuple = ()  # the kernels the plan takes from it: a PTX build must define each


def all_builds() -> list[Build]:
    """Every distinct build (file and -D defines) the backend could ask for on an H200 (sm_90),
    with a pool in the model dtype and an fp8 pool. bf16 (the GPU default) is taken through ptxas
    to a binary (with an fp8 pool, at the reference geometry); the rest to PTX (FAST_PTX), which
    runs every compile-time check of ours (static_assert) in less time. gemv.cu, the slowest
    build, is compiled with an fp8 pool in bf16 only: its fp8 pool code (the qkv epilogue's store)
    is the same for every model dtype."""
    configs = preset_configs() | {k: synthetic_config(*v) for k, v in SYNTHETIC.items()}
    builds = {}
    for name, config in configs.items():
        for dtype in DTYPES:
            for pool in (None, FP8_DTYPE):
                plan = plan_kernels(config, geometry(config, dtype, cache_dtype=pool), clusters=True, fp8_weights=True)
                what = f"{name} {str(dtype).removeprefix('torch.')}" + (" fp8 pool" if pool else "")
                cubin = dtype == torch.bfloat16 and (pool is None or name == "llama-3.2-1b")
                for file, (defines, names) in plan.files.items():
                    if pool is None or file != "gemv.cu" or dtype == torch.bfloat16:
                        builds.setdefault((file, defines), Build(what, file, defines, cubin, names=names))
    # the block sizes the kernels unroll over, at the reference geometry; and with a sliding window
    # (Mistral-7B-v0.1's, above at blocks of 16, on beside v0.3's geometry without one), the attention
    # kernels at blocks of 8, shorter than a key tile of the tensor-core decode (the window's first
    # tile then starts in a block that may have been given back) and of 64
    config = configs["llama-3.2-1b"]
    for block_size in (8, 32, 64):
        for pool in (None, FP8_DTYPE):
            plan = plan_kernels(config, geometry(config, torch.bfloat16, block_size, pool), clusters=True)
            for file, (defines, _) in plan.files.items():
                builds.setdefault((file, defines), Build(f"llama-3.2-1b block {block_size}", file, defines, False))
    config = configs["mistral-7b-v0.1"]
    for block_size in (8, 64):
        for pool in (None, FP8_DTYPE):
            plan = plan_kernels(config, geometry(config, torch.bfloat16, block_size, pool), clusters=True)
            for file in WINDOWED_FILES:
                defines, names = plan.files[file]
                builds.setdefault((file, defines), Build(f"mistral-7b-v0.1 block {block_size}", file, defines, False,
                                                         names=names))
    return list(builds.values())


WINDOWED_FILES = ("paged_attention.cu", "paged_decode_mma.cu", "paged_prefill.cu")  # what takes SLIDING_WINDOW


def nvcc(build: Build) -> tuple[bool, str]:
    """Whether the build compiles (and, to PTX, defines every kernel the plan names), and why not."""
    folder = kernel_folder()
    output = ("-cubin",) if build.cubin else ("-ptx", *FAST_PTX)
    with tempfile.TemporaryDirectory() as tmp:
        target = "/dev/null" if build.cubin else f"{tmp}/out.ptx"
        cmd = [NVCC, *COMPILE_OPTIONS, f"-arch={build.arch}", *output, "-o", target, f"-I{folder}",
               *define_flags(build.defines), str(folder / build.file)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0 or build.cubin:
            return done.returncode == 0, done.stderr
        entries = set(re.findall(r"\.entry\s+(\w+)", Path(target).read_text()))
    missing = sorted(set(build.names) - entries)  # (a kernel compiled under an #if the plan does not mirror)
    return not missing, f"the plan names kernels the build does not define: {', '.join(missing)}"


def compile_all(builds: list[Build]) -> list[tuple[bool, str]]:
    """nvcc for every build, one per core at once (each is a process: the threads only wait), the
    slowest (gemv.cu, cubins) first so that none runs alone at the end; in the order given."""
    order = sorted(range(len(builds)), key=lambda i: (builds[i].file != "gemv.cu", not builds[i].cubin))
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        done = dict(zip(order, pool.map(lambda i: nvcc(builds[i]), order)))
    return [done[i] for i in range(len(builds))]


def failures(builds: list[Build], results: list[tuple[bool, str]]) -> str:
    return "\n\n".join(f"{b.what}: {b.file} ({b.arch})\n{err[-600:]}" for b, (ok, err) in zip(builds, results) if not ok)


def test_every_kernel_compiles_for_every_preset_and_dtype():
    builds = all_builds()
    results = compile_all(builds)
    assert all(ok for ok, _ in results), failures(builds, results)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernels_compile_without_clusters_for_older_gpus(dtype):
    """sm_80 (A100): no thread-block clusters; the plan leaves the cluster kernel out. Without
    sm_89's fp8 conversions: gemv.cu's fp8 weights, and an fp8 pool's write and reads."""
    config = preset_configs()["llama-3.2-1b"]
    builds = []
    for pool in (None, FP8_DTYPE):
        # (gemv_quant.cu's loads on sm_80, in bf16: its dtype code is gemv.cu's, built here in both)
        quant = QUANT_FORMATS if pool is None and dtype == torch.bfloat16 else ()
        plan = plan_kernels(config, geometry(config, dtype, cache_dtype=pool), clusters=False, quant=quant)
        assert plan.files["paged_attention.cu"][1] == ("paged_attention_decode",)
        what = f"llama-3.2-1b {str(dtype).removeprefix('torch.')}" + (" fp8 pool" if pool else "")
        builds += [Build(what, file, plan.files[file][0], arch="sm_80")
                   for file in ("paged_attention.cu", "paged_prefill.cu", "paged_decode_mma.cu", "gemv.cu", "kv_write.cu",
                                "gemv_quant.cu")
                   if file in plan.files]
    results = compile_all(builds)
    assert all(ok for ok, _ in results), failures(builds, results)


def test_plan_sends_to_torch_only_what_the_kernel_cannot_serve():
    """Every preset has its decode kernel in every dtype (head_dim 100 in bf16, 200 bytes a row,
    with 8-byte loads), and its tensor-core prefill kernel in bf16 and fp16 (float32 prefill runs
    as torch ops). A row over a warp's loads (head_dim 256 in fp32: 1 KiB) runs as torch ops,
    with a reason naming the head_dim and dtype."""
    for name, config in preset_configs().items():
        for dtype in DTYPES:
            plan = plan_kernels(config, geometry(config, dtype), clusters=True)
            expected = ({"prefill attention"} if dtype == torch.float32 else set()) | family_fallbacks(config)
            assert set(plan.fallbacks) == expected, (name, dtype, plan.fallbacks)
            assert plan.attention_decode and plan.attention_prefill == (dtype != torch.float32)
            assert_window_defines(plan, config)
        plan = plan_kernels(config, geometry(config, torch.bfloat16), clusters=False, tensor_cores=False)
        assert "sm_80" in plan.fallbacks["prefill attention"]
        assert not plan.attention_prefill
    odd = synthetic_config(32, 32, 100)
    width = {dt: dict(plan_kernels(odd, geometry(odd, dt), clusters=True).files["paged_attention.cu"][0])
             ["ATTN_VEC_BYTES"] for dt in DTYPES}
    assert width == {torch.bfloat16: 8, torch.float16: 8, torch.float32: 16}
    wide = synthetic_config(8, 8, 256)
    plan = plan_kernels(wide, geometry(wide, torch.float32), clusters=True)
    assert not plan.attention_decode and "head_dim 256 in float32" in plan.fallbacks["decode attention"]
    assert plan_kernels(wide, geometry(wide, torch.bfloat16), clusters=True).attention_decode


def family_fallbacks(config: ModelConfig) -> set[str]:
    """What a family's additions send to other ops than the fused kernels (model/families/): Qwen2's
    q/k/v biases and Qwen3's head norms (the qkv GEMV's epilogue has neither). A sliding window
    sends nothing: the attention kernels take it (SLIDING_WINDOW)."""
    out = {"q/k/v projections"} if config.qkv_bias and not config.o_bias else set()
    return out | ({"q/k head norms"} if config.qk_norm else set())


def assert_window_defines(plan, config: ModelConfig) -> None:
    """The attention kernels are built with the model's window (0: none), the others without the
    define (their builds are the same for a model with or without a window)."""
    for file, (defines, _) in plan.files.items():
        window = dict(defines).get("SLIDING_WINDOW")
        assert window == ((config.sliding_window or 0) if file in WINDOWED_FILES else None), (file, window)


def test_a_sliding_window_is_served_by_our_attention_kernels():
    """Mistral-7B-v0.1 (a window of 4,096) has every attention kernel Mistral-7B-v0.3 (none, the
    same heads) has, in every dtype and pool, with SLIDING_WINDOW its only difference; no attention
    op falls back to torch for the window."""
    windowed, plain = preset_configs()["mistral-7b-v0.1"], preset_configs()["mistral-7b-v0.3"]
    assert windowed.sliding_window == 4096 and not plain.sliding_window
    for dtype in DTYPES:
        for pool in (None, FP8_DTYPE):
            a = plan_kernels(windowed, geometry(windowed, dtype, cache_dtype=pool), clusters=True)
            b = plan_kernels(plain, geometry(plain, dtype, cache_dtype=pool), clusters=True)
            assert a.fallbacks == b.fallbacks and a.files.keys() == b.files.keys(), (dtype, pool, a.fallbacks)
            assert "paged_attention.cu" in a.files
            assert {"paged_decode_mma.cu", "paged_prefill.cu"} <= a.files.keys() or dtype == torch.float32
            for file, (defines, names) in a.files.items():
                other = dict(b.files[file][0])
                if file in WINDOWED_FILES:
                    other["SLIDING_WINDOW"] = 4096
                assert dict(defines) == other and names == b.files[file][1], file


def test_decode_on_tensor_cores_where_the_model_is_bf16_or_fp16():
    """paged_decode_mma.cu (decode attention where one CTA per sequence and kv head fills the GPU)
    is built for every preset in bf16 and fp16, with a pool in the model dtype (head_dim 100's
    8-byte rows included) or an fp8 pool (rows of whole 8-byte e4m3 loads: not head_dim 100's),
    always beside paged_attention.cu (which serves the smaller batches); not for float32, a GPU
    before sm_80, or more query heads a kv head than one 16-row mma tile holds."""
    for name, config in preset_configs().items():
        for dtype in DTYPES:
            for pool in (None, FP8_DTYPE):
                plan = plan_kernels(config, geometry(config, dtype, cache_dtype=pool), clusters=True)
                built = "paged_decode_mma.cu" in plan.files
                expected = dtype != torch.float32 and (pool is None or config.head_dim % 8 == 0)
                assert built == expected, (name, dtype, pool)
                assert (plan.decode_mma_shared > 0) == built and (plan.attention_decode or not built)
        plan = plan_kernels(config, geometry(config, torch.bfloat16), clusters=False, tensor_cores=False)
        assert "paged_decode_mma.cu" not in plan.files and not plan.decode_mma_shared
    for heads, kv_heads, built in ((32, 2, True), (32, 1, False)):  # GQA 16: one full tile; 32: over it
        config = synthetic_config(heads, kv_heads, 64)
        assert ("paged_decode_mma.cu" in plan_kernels(config, geometry(config, torch.bfloat16), clusters=True).files) == built


def test_an_fp8_pool_has_its_kernels_where_the_model_dtype_has_them():
    """Every preset's fp8 pool is written and read by our kernels (no fallback but float32's
    prefill), compiled with KV_FP8 and the pool's 1-byte sizes; head_dim 100 (OpenLLaMA-3B:
    100-byte e4m3 rows, not whole 8-byte loads) runs both attentions as torch ops, saying why."""
    for name, config in preset_configs().items():
        for dtype in DTYPES:
            plan = plan_kernels(config, geometry(config, dtype, cache_dtype=FP8_DTYPE), clusters=True)
            expected = ({"prefill attention"} if dtype == torch.float32 else set()) | family_fallbacks(config)
            if config.head_dim == 100:
                expected = {"decode attention", "prefill attention"}
            assert set(plan.fallbacks) == expected, (name, dtype, plan.fallbacks)
            assert {"kv_write.cu", "gemv.cu"} <= set(plan.files)
            assert plan.attention_decode == (config.head_dim != 100)
            for file in ("kv_write.cu", "gemv.cu", "paged_attention.cu", "paged_prefill.cu", "paged_decode_mma.cu"):
                if file in plan.files:
                    defines = dict(plan.files[file][0])
                    assert "KV_FP8" in defines and defines["V_OFFSET"] == 16 * config.num_kv_heads * config.head_dim
    bf16 = plan_kernels(config, geometry(config, torch.bfloat16), clusters=True)
    assert all("KV_FP8" not in dict(d) for d, _ in bf16.files.values())
    odd = synthetic_config(32, 32, 100)
    plan = plan_kernels(odd, geometry(odd, torch.bfloat16, cache_dtype=FP8_DTYPE), clusters=True)
    assert set(plan.fallbacks) == {"decode attention", "prefill attention"}
    assert "fp8 pool" in plan.fallbacks["decode attention"] and "fp8 pool" in plan.fallbacks["prefill attention"]


HARNESS = textwrap.dedent("""
    // float32 values on stdin -> fp8.cuh's software e4m3 bytes on stdout
    #include <cstdio>
    #include "fp8.cuh"
    int main() {
        float f;
        while (fread(&f, sizeof f, 1, stdin) == 1) putchar((int)e4m3_from_float_software(f));
        return 0;
    }
""")


def test_software_e4m3_conversion_is_torchs_cast(tmp_path):
    """What sm_80 runs for an fp8 pool's writes, compiled for the host: bit for bit torch's
    e4m3(x.clamp(+-448)) (model/fp8.py's to_fp8) for every bf16 and fp16 number divided by scales
    that land them on every e4m3 binade, subnormals, the saturation edge and past it, and
    random float32 bit patterns (NaN and inf included)."""
    source = tmp_path / "harness.cu"
    source.write_text(HARNESS)
    program = tmp_path / "harness"
    done = subprocess.run([NVCC, "-std=c++17", "-DDTYPE_BF16", f"-I{kernel_folder()}", "-o", str(program), str(source)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    every16 = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16)
    values = [every16.view(torch.bfloat16).float(), every16.view(torch.float16).float()]
    values = [v / s for v in values for s in (1.0, 0.37, 3e-3, 2.0**-12, 17.0)]
    values.append(torch.randint(-(1 << 31), 1 << 31, (1 << 20,), dtype=torch.int64,
                                generator=torch.Generator().manual_seed(0)).to(torch.int32).view(torch.float32))
    values.append(torch.tensor([448.0, 464.0, 464.01, 479.9, 480.0, 1e30, float("inf"), 2.0**-6, 2.0**-10, 2.0**-9,
                                1.5 * 2.0**-10, 2.0**-11]))
    x = torch.cat(values)
    x = torch.cat([x, -x])
    out = subprocess.run([str(program)], input=x.numpy().tobytes(), capture_output=True).stdout
    ours = torch.frombuffer(bytearray(out), dtype=torch.uint8)
    want = to_fp8(x).view(torch.uint8)
    assert ours.shape == want.shape
    bad = (ours != want).nonzero().flatten()
    assert bad.numel() == 0, [(x[i].item(), hex(ours[i].item()), hex(want[i].item())) for i in bad[:8]]


def test_biases_and_dynamic_rope_are_named_as_torch_ops():
    base = {"architectures": ["LlamaForCausalLM"], "hidden_size": 256, "intermediate_size": 512,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
            "max_position_embeddings": 64}
    cases = {"q/k/v and o projections": {"attention_bias": True}, "gate/up and down projections": {"mlp_bias": True},
             "RoPE and the K/V write": {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}}
    for op, extra in cases.items():
        config = ModelConfig.from_dict(base | extra, source="test")
        plan = plan_kernels(config, geometry(config, torch.bfloat16), clusters=True)
        assert set(plan.fallbacks) == {op} and plan.attention_decode and plan.attention_prefill


def test_shared_memory_mirror_matches_the_kernel():
    """cuda_build's sum of the decode kernel's shared memory is the kernel's own: a shape just over
    the limit by the Python count fails nvcc's static_assert, one just under compiles."""
    base = AttentionShape(head_dim=256, itemsize=2, heads_per_cta=8, block_size=16, unroll=2)
    assert base.unsupported() is None  # 8 heads of 256 in bf16 fit
    config = synthetic_config(64, 8, 256)
    plan = plan_kernels(config, geometry(config, torch.bfloat16), clusters=True)
    defines = plan.files["paged_attention.cu"][0]
    # ATTN_STAGES 8 doubles the ring: the Python count says over 48 KiB, and so must the compiler
    bigger = tuple((k, 8 if k == "ATTN_STAGES" else v) for k, v in defines)
    import pagedcli.backends.cuda_build as cb

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cb, "ATTN_STAGES", 8)
        assert replace(base).shared_bytes() > cb.ATTN_STATIC_SHARED
    (ok, err), (ok_bigger, err_bigger) = compile_all([Build("64 heads of 256", "paged_attention.cu", defines),
                                                      Build("ATTN_STAGES 8", "paged_attention.cu", bigger)])
    assert ok, err
    assert not ok_bigger and "shared memory over 48 KiB" in err_bigger


def ptx_of(build: Build) -> str:
    """The PTX nvcc makes of a build, with the full optimizer (the order of its memory operations is
    what the backend's NVRTC build has)."""
    folder = kernel_folder()
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [NVCC, *COMPILE_OPTIONS, f"-arch={build.arch}", "-ptx", "-o", f"{tmp}/out.ptx", f"-I{folder}",
               *define_flags(build.defines), str(folder / build.file)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-600:]
        return Path(f"{tmp}/out.ptx").read_text()


# A PTX instruction that reads or writes global memory (or memory of unknown space): ld, st, atom,
# red, cp.async and prefetch, unless of the kernel's parameters, shared or local memory; and a call
# (whatever it does is out of sight here).
GLOBAL_ACCESS = re.compile(r"^\s*(?:@!?%p\d+\s+)?(?:(?:ldu?|st|atom|red|cp\.async|prefetch|tex|multimem)"
                           r"(?!\.(?:param|shared|local|const)\b)(?:\.[\w:]+)*\s|call\b)", re.M)
# gemv.cu's weight loads (load_weight with GEMV_EVICT_FIRST, the plan's: past L1 with an L2
# eviction hint, which no other load of gemv.cu has; a compressed weight's group scales and offsets,
# load_group, likewise as f32), the only global access a kernel of ours makes before
# wait_for_previous_kernels.
WEIGHT_LOAD = re.compile(r"ld\.global\.nc\.L1::no_allocate\.L2::cache_hint\.(?:v4\.u32|f32)")
# paged_attention.cu's reads of what the host copied in before the step (lengths, slots, block
# table entries: host_written, past L1), before the wait with ATTN_READ_BATCH_EARLY.
HOST_WRITTEN_READ = re.compile(r"^(?:@!?%p\d+\s+)?ld\.global\.cg\.s32$")


PTX_LABEL = re.compile(r"^(\$[\w$]+):", re.M)
PTX_BRANCH = re.compile(r"^\s*(@!?%p\d+\s+)?bra(?:\.uni)?\s+(\$[\w$]+);")
PTX_END = re.compile(r"^\s*(?:ret|exit|trap);")


def accesses_before_wait(body: str) -> list[str]:
    """The global accesses (GLOBAL_ACCESS) of a kernel's PTX that some path from its entry reaches
    without passing an unpredicated griddepcontrol.wait: its basic blocks (at labels), followed
    along branches and fall-throughs from the entry until a wait."""
    starts = [0] + [m.start() for m in PTX_LABEL.finditer(body)]
    blocks = [body[a:b] for a, b in zip(starts, starts[1:] + [len(body)])]
    index = {m.group(1): i for i, m in enumerate(PTX_LABEL.finditer(body), start=1)}
    found, seen, todo = [], set(), [0]
    while todo:
        i = todo.pop()
        if i in seen or i >= len(blocks):
            continue
        seen.add(i)
        ends = False
        for line in blocks[i].splitlines():
            if re.match(r"^\s*griddepcontrol\.wait;", line):
                ends = True  # this path has waited: what follows it may touch anything
                break
            if m := GLOBAL_ACCESS.match(line):
                found.append(m.group(0).strip())
            if m := PTX_BRANCH.match(line):
                todo.append(index[m.group(2)])
                if not m.group(1):  # unconditional: no fall-through
                    ends = True
                    break
            if PTX_END.match(line):
                ends = True
                break
        if not ends:
            todo.append(i + 1)
    return found


def test_every_kernel_waits_for_the_previous_kernel_before_touching_memory():
    """On sm_90+ our kernels are launched to start before the previous kernel in the stream has
    finished (cuda_launch.Launcher, kernels/common.cuh): each must execute griddepcontrol.wait before
    any access to global memory, but gemv.cu's loads of its first weight tile (which no kernel
    writes) and, with fp8 weights, the split-KV decode kernel's reads of the host's batch and block
    table, and lets the next kernel be scheduled before its own end. Checked along every path of
    the PTX of every file of the Llama-3.2-1B plan, bf16 and fp8 pools, bf16 and fp8 weights, and
    float32; a kernel that read its input or wrote its output before the wait would race with the
    kernel before it. (An int read past L1 before the wait passes as a read of the batch: which
    array it reads is out of this check's sight.)"""
    config = preset_configs()["llama-3.2-1b"]
    builds = {}
    for dtype, pool in ((torch.bfloat16, None), (torch.bfloat16, FP8_DTYPE), (torch.float32, None)):
        for fp8_weights in (False, True):  # (paged_attention.cu reads the batch early with fp8 weights)
            plan = plan_kernels(config, geometry(config, dtype, cache_dtype=pool), clusters=True, fp8_weights=fp8_weights,
                                quant=QUANT_FORMATS)  # (gemv_quant.cu: compressed weights)
            label = f"{dtype} {pool}{' fp8 weights' if fp8_weights else ''}"
            for file, (defines, names) in plan.files.items():
                builds.setdefault((file, defines), Build(label, file, defines, cubin=False, names=names))
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        ptxs = list(pool.map(ptx_of, builds.values()))
    checked, early_readers, problems = 0, 0, []
    for build, ptx in zip(builds.values(), ptxs):
        for name, body in re.findall(r"\.entry\s+(\w+)\s*\((.*?)(?=\.entry\s|\Z)", ptx, re.S):
            if name not in build.names:
                continue
            checked += 1
            if "griddepcontrol.wait;" not in body or "griddepcontrol.launch_dependents;" not in body:
                problems.append(f"{build.file} {name}: no griddepcontrol.wait, or no launch_dependents")
                continue
            early = accesses_before_wait(body)
            gemv = name.startswith(("gemv_", "gemv8_", "gemvq"))
            decode_early = name.startswith("paged_attention_decode") and ("ATTN_READ_BATCH_EARLY", 1) in build.defines
            early_readers += decode_early
            allowed = WEIGHT_LOAD if gemv else HOST_WRITTEN_READ if decode_early else None
            bad = [line for line in early if not (allowed and allowed.search(line))]
            if bad:
                problems.append(f"{build.file} {name} ({build.what}): before the wait: {bad[:3]}")
            if (gemv or decode_early) and not early:
                problems.append(f"{build.file} {name} ({build.what}): no load before the wait (the overlap is lost)")
    assert not problems, "\n".join(problems)
    assert checked >= 40, f"only {checked} kernels checked"
    assert early_readers >= 4, "no decode kernel of the fp8-weights plans reads the batch before its wait"


# --- compressed weights (model/quant.py's QuantWeight: backends/cuda_quant.py) ----------------------

# (bits, group, out, in): 4-bit group 128 and per channel, 8-bit group 32 (GGUF Q8_0), 16 (Q6_K)
QUANT_FORMATS = ((4, 128, 3072, 2048), (4, 2048, 2048, 2048), (8, 32, 2048, 2048), (8, 16, 2048, 8192))


def test_compressed_weight_kernels_compile_for_every_preset():
    """gemv_quant.cu (gemv.cu's gemvq4_ and gemvq8_ kernels) for every preset and synthetic geometry
    in every dtype as the plan builds it (PTX: every kernel the plan names is defined), with an fp8
    pool in bf16 (the qkv epilogue's store), and through ptxas in bf16 for Llama-3.2-1B (the
    registers its launch bounds allow)."""
    configs = preset_configs() | {k: synthetic_config(*v) for k, v in SYNTHETIC.items()}
    builds = {}
    for name, config in configs.items():
        for dtype, pool in [(d, None) for d in DTYPES] + [(torch.bfloat16, FP8_DTYPE)]:
            plan = plan_kernels(config, geometry(config, dtype, cache_dtype=pool), clusters=True, quant=QUANT_FORMATS)
            defines, names = plan.files["gemv_quant.cu"]
            what = f"{name} {str(dtype).removeprefix('torch.')}" + (" fp8 pool" if pool else "")
            cubin = name == "llama-3.2-1b" and dtype == torch.bfloat16 and pool is None
            builds.setdefault(defines, Build(what, "gemv_quant.cu", defines, cubin, names=names))
    builds = list(builds.values())
    assert len(builds) >= 2 * len(configs)  # (presets of the same geometry share a build)
    results = compile_all(builds)
    assert all(ok for ok, _ in results), failures(builds, results)


def test_the_plan_builds_compressed_weight_kernels_only_for_their_bits():
    """gemv_quant.cu is planned only for a model with QuantWeights, with the kernels of their bits
    (the same -D defines as gemv.cu's and its own launch bounds), and what goes past 2 rows to a
    dequantized copy is named: 8-bit weights, groups or dtypes torch's int4 GEMM does not take."""
    from pagedcli.backends.cuda_build import GEMV_QUANT_CTAS_PER_SM, quant_kernel_names

    config = preset_configs()["llama-3.2-1b"]
    bf16 = geometry(config, torch.bfloat16)
    assert "gemv_quant.cu" not in plan_kernels(config, bf16, clusters=True).files
    int4 = plan_kernels(config, bf16, clusters=True, quant=((4, 128, 3072, 2048), (4, 64, 2048, 8192)))
    defines, names = int4.files["gemv_quant.cu"]
    assert dict(defines) == dict(int4.files["gemv.cu"][0]) | {"GEMV_QUANT_MIN_CTAS": GEMV_QUANT_CTAS_PER_SM}
    assert names == tuple(quant_kernel_names((4,))) and len(names) == 10
    assert all(n.startswith("gemvq4_") for n in names) and "gemvq4_2_rms_norm_rope_kv" in names
    assert not any("compressed" in op for op in int4.fallbacks), int4.fallbacks
    both = plan_kernels(config, bf16, clusters=True, quant=QUANT_FORMATS)
    assert set(both.files["gemv_quant.cu"][1]) == set(quant_kernel_names((4, 8)))
    assert "8-bit weights" in both.fallbacks["compressed linear layers over 2 rows"]
    fp16 = plan_kernels(config, geometry(config, torch.float16), clusters=True, quant=((4, 128, 3072, 2048),))
    assert "bfloat16 activations" in fp16.fallbacks["compressed linear layers over 2 rows"]
    odd = plan_kernels(config, bf16, clusters=True, quant=((4, 16, 64, 2048), (8, 96, 64, 2016)))
    small = odd.fallbacks["compressed linear layers at 1 and 2 rows"]
    assert "groups of 16" in small and "groups of 96" in small


def test_gemv_quant_kernels_hold_their_registers_without_much_spilling():
    """The compressed weights' GEMVs at GEMV_QUANT_CTAS_PER_SM (their launch bounds) through ptxas on
    sm_90: each kernel within the registers the bound allows and at most 64 bytes of spill stores
    (the 1-row kernels none): more would mean a change made the dequantization heavier than the
    bound the grid is sized for (cuda_build.GEMV_QUANT_CTAS_PER_SM says what was measured)."""
    config = preset_configs()["llama-3.2-1b"]
    plan = plan_kernels(config, geometry(config, torch.bfloat16), clusters=True, quant=QUANT_FORMATS)
    defines, names = plan.files["gemv_quant.cu"]
    folder = kernel_folder()
    cmd = [NVCC, *COMPILE_OPTIONS, "-arch=sm_90", "-cubin", "-o", "/dev/null", "-Xptxas", "-v", f"-I{folder}",
           *define_flags(defines), str(folder / "gemv_quant.cu")]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-600:]
    found = {}
    for name, body in re.findall(r"Compiling entry function '(\w+)'(.*?)(?=Compiling entry|\Z)", done.stderr, re.S):
        spill = int(re.search(r"(\d+) bytes spill stores", body).group(1))
        registers = int(re.search(r"Used (\d+) registers", body).group(1))
        found[name] = (registers, spill)
    assert set(found) == set(names), sorted(set(names) ^ set(found))
    limit = 65536 // (dict(defines)["GEMV_QUANT_MIN_CTAS"] * dict(defines)["GEMV_THREADS"])
    for name, (registers, spill) in found.items():
        assert registers <= limit and spill <= (0 if "_1_" in name and "rope_kv" not in name else 64), (name, registers, spill)


def test_kernels_awaiting_their_gpu_tests_are_used_only_when_asked(monkeypatch):
    """Without PAGEDCLI_UNVERIFIED_KERNELS=1 a windowed model's attention and compressed weights at
    1 and 2 rows take the paths they took before the new kernels (named in the plan's notices), and
    no windowed or compressed-weight build is planned; with it, both are (the other tests here)."""
    from pagedcli.backends.cuda_build import UNVERIFIED_KERNELS_VAR

    monkeypatch.delenv(UNVERIFIED_KERNELS_VAR, raising=False)
    windowed = preset_configs()["mistral-7b-v0.1"]
    plan = plan_kernels(windowed, geometry(windowed, torch.bfloat16), clusters=True)
    assert not {"paged_attention.cu", "paged_decode_mma.cu", "paged_prefill.cu"} & plan.files.keys()
    for op in ("decode attention", "prefill attention"):
        assert UNVERIFIED_KERNELS_VAR in plan.fallbacks[op] and "sliding_window 4096" in plan.fallbacks[op]
    config = preset_configs()["llama-3.2-1b"]
    plain = plan_kernels(config, geometry(config, torch.bfloat16), clusters=True)
    assert "paged_attention.cu" in plain.files and "decode attention" not in plain.fallbacks
    quant = plan_kernels(config, geometry(config, torch.bfloat16), clusters=True, quant=((4, 128, 3072, 2048),))
    assert "gemv_quant.cu" not in quant.files
    assert UNVERIFIED_KERNELS_VAR in quant.fallbacks["compressed linear layers at 1 and 2 rows"]
    monkeypatch.setenv(UNVERIFIED_KERNELS_VAR, "1")
    assert "paged_attention.cu" in plan_kernels(windowed, geometry(windowed, torch.bfloat16), clusters=True).files
