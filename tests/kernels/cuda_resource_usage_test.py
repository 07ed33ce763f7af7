#!/usr/bin/env python3
"""Register spills and stack frames of the CUDA kernels (kernels/cuda/*.cu, SOURCES below).

Compiles each file's device code only (nvcc -cubin: no host compile) for every architecture the
build targets, with `--resource-usage -Xptxas --warn-on-spills`, and reads ptxas's report of each
function. It fails when
  - any function spills registers (spill stores or loads > 0, or ptxas's spill warning),
  - a decode kernel (DECODE_KERNELS) or the prefill attention kernel (PREFILL_KERNELS) has a
    stack frame: their accumulators and tiles must stay in registers and shared memory,
  - one of those kernels, or of STACK_ALLOWED_KERNELS, is missing from an architecture's report
    (a rename must update these lists).
RopeKernel and RopeKvWriteKernel may keep a stack: precise sinf/cosf keep a 32-byte one for their
slow argument reduction (positions times inverse frequencies reach 1e5 radians); they must not
spill.

Exits 77 (ctest's SKIP_RETURN_CODE) when no nvcc is found. `--self-test` checks the parser and
the rules on canned ptxas output and needs no nvcc.
"""
import argparse
import concurrent.futures
import os
import re
import shutil
import subprocess
import sys

SKIP = 77

# The kernels a decode step launches, by the name they have in the source.
DECODE_KERNELS = [
    "EmbeddingKernel", "RmsNormKernel", "AddRmsNormKernel", "AddKernel", "SiluMulKernel",
    "F32ToBf16Kernel", "GatherRowsKernel", "KvWriteKernel", "PagedAttentionKernel",
    "MergeSplitsKernel",
]

# The FA2-style prefill attention (kernels/cuda/prefill_attention.cu) and its tensor-core variant
# (kernels/cuda/prefill_attention_tc.cu), every storage and head_dim.
PREFILL_KERNELS = ["PrefillAttentionKernel", "PrefillAttentionTcKernel"]
# Present and spill-free, a stack allowed (precise sinf/cosf).
STACK_ALLOWED_KERNELS = ["RopeKernel", "RopeKvWriteKernel"]
NO_STACK_KERNELS = DECODE_KERNELS + PREFILL_KERNELS
REQUIRED_KERNELS = NO_STACK_KERNELS + STACK_ALLOWED_KERNELS

# The files compiled, under kernels/cuda/.
SOURCES = ["backend_kernels.cu", "prefill_attention.cu", "prefill_attention_tc.cu", "rope_kv_write.cu"]

_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(sm_\d+a?)'")
_PROPS = re.compile(r"Function properties for (\S+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_SPILL_WARNING = re.compile(r"ptxas warning\s*:\s*Registers are spilled to local memory in function '([^']+)'")


def parse(text, arch):
    """{function: (stack, spill_stores, spill_loads)} and the functions ptxas warned about."""
    usage, warned, current = {}, set(), None
    for line in text.splitlines():
        m = _ENTRY.search(line)
        if m:
            if m.group(2) != arch:
                raise ValueError(f"ptxas compiled {m.group(1)} for {m.group(2)}, not {arch}")
            continue
        m = _PROPS.search(line)
        if m:
            current = m.group(1)
            continue
        m = _FRAME.search(line)
        if m and current is not None:
            usage[current] = tuple(int(g) for g in m.groups())
            current = None
            continue
        m = _SPILL_WARNING.search(line)
        if m:
            warned.add(m.group(1))
    return usage, warned


def _is_kernel(function, name):
    # Mangled (_ZN...<len><name>...) or demangled (...::name<...>(...)) spellings.
    return f"{len(name)}{name}" in function or re.search(rf"\b{name}\b", function) is not None


def check(usage, warned, arch):
    """One line per problem (empty when the architecture passes)."""
    problems = []
    for function, (stack, stores, loads) in sorted(usage.items()):
        if stores or loads:
            problems.append(f"{arch}: {function} spills registers "
                            f"({stores} bytes spill stores, {loads} bytes spill loads)")
    for function in sorted(warned):
        problems.append(f"{arch}: ptxas warns that {function} spills registers")
    for name in REQUIRED_KERNELS:
        found = [f for f in usage if _is_kernel(f, name)]
        if not found:
            problems.append(f"{arch}: kernel {name} is not in ptxas's report")
        if name not in NO_STACK_KERNELS:
            continue
        for function in found:
            if usage[function][0]:
                problems.append(f"{arch}: kernel {function} has a "
                                f"{usage[function][0]}-byte stack frame")
    return problems


def compile_report(nvcc, source_dir, arch, name):
    source = os.path.join(source_dir, "kernels", "cuda", name)
    cmd = [nvcc, "-std=c++17", "-O3", "-DNDEBUG", f"-I{source_dir}", "--resource-usage",
           "-Xptxas", "--warn-on-spills", "-cubin", f"-arch={arch}", source, "-o", os.devnull]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}")
    return proc.stdout


def find_nvcc(given):
    for candidate in (given, os.environ.get("CUDACXX"), shutil.which("nvcc"),
                      "/usr/local/cuda/bin/nvcc"):
        if candidate and candidate != "NOTFOUND" and not candidate.endswith("-NOTFOUND") \
                and os.access(candidate, os.X_OK):
            return candidate
    return None


_CANNED = """\
ptxas info    : Compiling entry function '_ZN7kvshard4cuda12_GLOBAL__N_120PagedAttentionKernelILi0EEEvNS1_8AttnArgsE' for 'sm_80'
ptxas info    : Function properties for _ZN7kvshard4cuda12_GLOBAL__N_120PagedAttentionKernelILi0EEEvNS1_8AttnArgsE
    {attn_stack} bytes stack frame, {attn_spill} bytes spill stores, {attn_spill} bytes spill loads
ptxas info    : Used 96 registers, used 1 barriers, 3344 bytes smem, 520 bytes cmem[0]
ptxas info    : Compiling entry function '_ZN7kvshard4cuda12_GLOBAL__N_110RopeKernelEPflPKillPKf' for 'sm_80'
ptxas info    : Function properties for _ZN7kvshard4cuda12_GLOBAL__N_110RopeKernelEPflPKillPKf
    32 bytes stack frame, {rope_spill} bytes spill stores, 0 bytes spill loads
ptxas info    : Used 30 registers, used 0 barriers, 32 bytes cumulative stack size
{warning}"""


def self_test():
    def problems(**kw):
        fields = dict(attn_stack=0, attn_spill=0, rope_spill=0, warning="")
        fields.update(kw)
        usage, warned = parse(_CANNED.format(**fields), "sm_80")
        # Only PagedAttentionKernel and RopeKernel are in the canned report: the others are missing.
        missing = len(REQUIRED_KERNELS) - 2
        found = check(usage, warned, "sm_80")
        assert sum("is not in ptxas's report" in p for p in found) == missing, found
        return [p for p in found if "is not in ptxas's report" not in p]

    assert problems() == [], problems()  # Rope's stack is allowed, nothing spills
    assert any("PagedAttentionKernel" in p and "40-byte stack" in p for p in problems(attn_stack=40))
    assert any("PagedAttentionKernel" in p and "spills" in p for p in problems(attn_stack=8, attn_spill=8))
    assert any("RopeKernel" in p and "spills" in p for p in problems(rope_spill=4))
    warning = ("ptxas warning : Registers are spilled to local memory in function "
               "'_ZN7kvshard4cuda12_GLOBAL__N_117MergeSplitsKernelEPKiPKfillPf', 8 bytes spill stores, 8 bytes spill loads")
    assert any("MergeSplitsKernel" in p for p in problems(warning=warning))
    try:
        parse(_CANNED.format(attn_stack=0, attn_spill=0, rope_spill=0, warning=""), "sm_90")
        raise AssertionError("a report for another architecture was accepted")
    except ValueError:
        pass
    # The prefill kernel may not keep a stack either; RopeKvWriteKernel may (precise sinf/cosf).
    prefill = ("ptxas info    : Function properties for _ZN7kvshard4cuda53_GLOBAL__N__26d6e616_20_"
               "prefill_attention_cu_8393b6e022PrefillAttentionKernelILNS_7KvDtypeE0ELi128EEEvNS1_11PrefillArgsE\n"
               "    16 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
               "ptxas info    : Function properties for _ZN7kvshard4cuda12_GLOBAL__N_117RopeKvWriteKernel"
               "ILNS_7KvDtypeE0EEEvPfS3_PKflPKiPKllS5_NS0_6KvArgsE\n"
               "    32 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
               "ptxas info    : Function properties for _ZN7kvshard4cuda56_GLOBAL__N__67ddc845_23_"
               "prefill_attention_tc_cu_d96a1f3224PrefillAttentionTcKernelILNS_7KvDtypeE4ELi128EEEvNS1_6TcArgsE\n"
               "    8 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n")
    usage, warned = parse(prefill, "sm_80")
    found = check(usage, warned, "sm_80")
    assert any("PrefillAttentionKernel" in p and "16-byte stack" in p for p in found), found
    assert any("PrefillAttentionTcKernel" in p and "8-byte stack" in p for p in found), found
    assert not any("RopeKvWriteKernel" in p for p in found), found
    assert _is_kernel("_ZN7kvshard4cuda12_GLOBAL__N_116AddRmsNormKernelEPf", "AddRmsNormKernel")
    assert not _is_kernel("_ZN7kvshard4cuda12_GLOBAL__N_116AddRmsNormKernelEPf", "RmsNormKernel")
    print("self-test passed")
    return 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nvcc", default="", help="nvcc (default: CUDACXX, PATH, /usr/local/cuda)")
    parser.add_argument("--source-dir", default=os.path.join(os.path.dirname(__file__), "..", ".."))
    parser.add_argument("--archs", default="80;90", help="';'-separated, as KVSHARD_CUDA_ARCHITECTURES")
    parser.add_argument("--self-test", action="store_true")
    args = parser.parse_args()
    if args.self_test:
        return self_test()
    nvcc = find_nvcc(args.nvcc)
    if nvcc is None:
        print("SKIP: no nvcc (set --nvcc or CUDACXX)")
        return SKIP
    archs = [f"sm_{a.strip()}" for a in args.archs.replace(",", ";").split(";") if a.strip()]
    try:
        jobs = [(arch, name) for arch in archs for name in SOURCES]
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(len(jobs), 4)) as pool:
            texts = list(pool.map(
                lambda job: compile_report(nvcc, os.path.abspath(args.source_dir), *job), jobs))
        reports = {arch: "\n".join(t for (a, _), t in zip(jobs, texts) if a == arch)
                   for arch in archs}
    except RuntimeError as error:
        print(f"FAIL {error}")
        return 1
    problems = []
    for arch, text in reports.items():
        usage, warned = parse(text, arch)
        problems += check(usage, warned, arch)
        kernels = sum(any(_is_kernel(f, k) for f in usage) for k in REQUIRED_KERNELS)
        print(f"{arch}: {len(usage)} functions, {kernels}/{len(REQUIRED_KERNELS)} listed kernels found")
    for p in problems:
        print(f"FAIL {p}")
    if problems:
        return 1
    print("no spills anywhere, no stack frame in the decode and prefill kernels")
    return 0


if __name__ == "__main__":
    sys.exit(main())
