"""Compile JAX programs for an NVIDIA H200 (sm_90a) on a machine without a GPU.

    from kipp.cuda import aot
    build = aot.compile_for_h200(jax.jit(f), aot.spec((512, 1024), jnp.float32))
    build.kernels  # per GPU kernel: registers, spill bytes, shared memory, tensor-core ops

An abstract H200 comes from `jax.experimental.topologies` (the CUDA PJRT plugin, without CUDA
libraries or a driver) and `.lower(lowering_platforms=("cuda",)).compile()` then runs what the
GPU machine would: Pallas' Triton lowering, Triton's GPU passes, LLVM NVPTX and `ptxas
-arch=sm_90a`, returning a real executable or the real error (a kernel over the shared-memory
limit fails here as it would there). Nothing runs: numerics are the interpret-mode tests' job.

Needs, at jax's own version: jax-cuda12-plugin and jax-cuda12-pjrt (`jax[cuda12-local]`), and
nvidia-cuda-nvcc-cu12 for ptxas (the `dev` extra, Linux); without a GPU, JAX must start with no
CUDA in `jax_platforms` (kipp.cuda.startup, `host_setup`). The report comes from XLA's dump of
the build (`xla_dump_to`): the PTX handed to ptxas (`ptxas -v`: registers and spills per
kernel) and the thunk sequence with each kernel's launch (grid, threads, shared memory).
"""

from __future__ import annotations

import contextlib
import ctypes.util
import importlib.util
import os
import re
import subprocess
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import jax

from kipp.errors import KippError

DEVICE_KIND = "NVIDIA H200"
SM_COUNT = 132
ARCH = "sm_90a"

# XLA's GpuTargetConfig for one H200 SXM (compute capability 9.0, 132 SMs, 227 KiB of opt-in
# shared memory per block, 64K registers per SM). On a machine with an H200, the real one is
# jax._src.lib._jax.get_topology_for_devices(jax.devices()[:1]).target_config.
H200_TARGET_CONFIG = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 150000000000
  shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 minor: 0 }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 8 }
runtime_version { major: 12 minor: 8 }
device_description_str: "NVIDIA H200"
"""


class AotUnavailable(KippError):
    """This machine cannot compile for the H200 (a package missing, or JAX started too early)."""


def host_setup() -> None:
    """On a machine without an NVIDIA driver, start JAX on the CPU only, which also lets the
    CUDA plugin register (its CUDA check is skipped); call before JAX starts its backends.
    Does nothing where a driver exists or `jax_platforms` was chosen already."""
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized() or jax.config.jax_platforms:
        return
    if ctypes.util.find_library("cuda") is None:
        jax.config.update("jax_platforms", "cpu")


def unavailable_reason() -> str | None:
    """Why this machine cannot compile for the H200, or None when it can."""
    for module, package in (("jax_plugins.xla_cuda12", "jax-cuda12-plugin"),
                            ("nvidia.cuda_nvcc", "nvidia-cuda-nvcc-cu12")):
        if importlib.util.find_spec(module) is None:
            return f"{package} is not installed (the dev extra installs it on Linux)"
    try:
        devices(1)
    except AotUnavailable as e:
        return str(e)
    return None


_TOPOLOGIES: dict = {}  # devices(count) or devices(count, hosts)


def devices(count: int = 1, hosts: int = 1) -> list:
    """`count` compile-only H200 devices of one host (an abstract node of up to 8 GPUs), or
    of `hosts` hosts with count / hosts each (in host order: a device's process_index is its
    host)."""
    if count % hosts:
        raise ValueError(f"{count} devices do not split over {hosts} hosts")
    key = count if hosts == 1 else (count, hosts)
    if key not in _TOPOLOGIES:
        from jax.experimental import topologies

        host_setup()
        try:
            topology = topologies.get_topology_desc(
                platform="cuda", target_config=H200_TARGET_CONFIG,
                topology=f"1x{hosts}x{count // hosts}")
        except (NotImplementedError, RuntimeError) as e:
            raise AotUnavailable(
                f"no CUDA topology ({str(e).splitlines()[0]}): the CUDA plugin did not register; "
                "on a machine without a GPU, start JAX with JAX_PLATFORMS=cpu") from None
        _TOPOLOGIES[key] = list(topology.devices)
    return _TOPOLOGIES[key]


@contextlib.contextmanager
def gpu_target(mesh=None):
    """Make Pallas lower its kernels for the H200 while the default device is a CPU.

    jax >= 0.11 reads the GPU kind from the current abstract mesh's device; older jax reads
    the default device and tolerates this. A sharded program's arguments name their own mesh
    of abstract H200s (`mesh`, a jax.sharding.Mesh), which must be the context's too. Scoped to
    the lowering only: entered for a whole process it would also steer interpret-mode runs."""
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

    if mesh is not None:
        abstract = mesh.abstract_mesh
    else:
        device = AbstractDevice(device_kind=DEVICE_KIND, num_cores=SM_COUNT, platform="gpu")
        abstract = AbstractMesh((1,), ("gpu",), (AxisType.Explicit,), abstract_device=device)
    with use_abstract_mesh(abstract):
        yield


def spec(shape, dtype, sharding=None) -> jax.ShapeDtypeStruct:
    """An argument of `shape` and `dtype` on the abstract H200 (or on `sharding`)."""
    if sharding is None:
        sharding = jax.sharding.SingleDeviceSharding(devices(1)[0])
    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)


def on_h200(tree):
    """A pytree of arrays or ShapeDtypeStructs as specs on the abstract H200."""
    return jax.tree.map(lambda a: spec(a.shape, a.dtype), tree)


@dataclass(frozen=True)
class KernelStats:
    """One GPU kernel of a build, as ptxas and XLA's launch saw it."""

    name: str
    registers: int  # per thread
    spill_stores: int  # bytes per thread
    spill_loads: int
    stack: int  # bytes of local-memory stack frame per thread (spills and local arrays)
    shared_memory: int  # dynamic shared memory per block (bytes), from the launch
    grid: tuple[int, int, int]
    threads: int  # per block
    mma: dict  # tensor-core instructions in the PTX: {"wgmma.bf16": 12, "mma.sync.tf32": 4}
    f32_ops: int  # float32 add/mul/fma instructions in the PTX (CUDA cores)

    @property
    def spills(self) -> int:
        return self.spill_stores + self.spill_loads


@dataclass
class Build:
    """A finished H200 compile: the executable, its kernels and how long it took."""

    compiled: object
    kernels: list[KernelStats]
    seconds: float

    def kernel(self, prefix: str) -> list[KernelStats]:
        return [k for k in self.kernels if k.name.startswith(prefix)]


def compile_for_h200(fn, *args, report: bool = True, xla_kernels: bool = False) -> Build:
    """Lower and compile `fn` (jitted, or a plain function) for the H200 with `args` (arrays
    or ShapeDtypeStructs; unsharded ones are placed on the abstract H200). Raises whatever the
    lowering, Triton, LLVM or ptxas raise. `xla_kernels`: the report covers XLA's own fused
    kernels too (the twins' steps have no Pallas kernel), not only the Pallas ones."""
    jitted = fn if hasattr(fn, "trace") else jax.jit(fn)
    args = jax.tree.map(_placed, args)
    meshes = {a.sharding.mesh for a in jax.tree.leaves(args)
              if isinstance(getattr(a, "sharding", None), jax.sharding.NamedSharding)}
    if len(meshes) > 1:
        raise ValueError(f"arguments span {len(meshes)} meshes; compile on one")
    with tempfile.TemporaryDirectory(prefix="kipp-aot-") as dump:
        start = time.perf_counter()
        with gpu_target(next(iter(meshes), None)):
            lowered = jitted.trace(*args).lower(lowering_platforms=("cuda",))
        # jax >= 0.11 dumps the PTX only for the emitter stages this names (".*" would also
        # write each Triton pass's IR: tens of MB and seconds per kernel)
        options = {"xla_dump_to": dump, "xla_dump_emitter_re": "ptx"} if report else {}
        compiled = lowered.compile(compiler_options=options)
        seconds = time.perf_counter() - start
        kernels = _kernel_stats(Path(dump), xla_kernels) if report else []
    return Build(compiled, kernels, seconds)


def _placed(a):
    if isinstance(a, jax.ShapeDtypeStruct) and a.sharding is None:
        return spec(a.shape, a.dtype)
    return a


def ptxas() -> Path:
    """The ptxas of nvidia-cuda-nvcc-cu12 (the one XLA runs)."""
    found = importlib.util.find_spec("nvidia.cuda_nvcc")
    if found is None or not found.submodule_search_locations:
        raise AotUnavailable("nvidia-cuda-nvcc-cu12 is not installed (ptxas)")
    return Path(list(found.submodule_search_locations)[0]) / "bin" / "ptxas"


_LAUNCH = re.compile(r"kCustomKernel.*?(\S+) grid: \[(\d+), (\d+), (\d+)\] "
                     r"threads: \[(\d+), (\d+), (\d+)\]\s+shared_memory: (\d+) bytes")


def _kernel_stats(dump: Path, xla_kernels: bool = False) -> list[KernelStats]:
    """Per Pallas kernel (and with `xla_kernels`, per XLA fusion too) of the dumped build:
    ptxas -v on its PTX plus its launch."""
    pallas = set()  # XLA's own fusions launch as custom kernels too: keep the Triton calls
    for path in dump.glob("*after_optimizations.txt"):
        for line in path.read_text().splitlines():
            if 'custom_call_target="__gpu$xla.gpu.triton"' in line:
                pallas.update(re.findall(r'\bname = "([^"]+)"', line))
    launches = {}
    for path in dump.glob("*thunk_sequence*.txt"):
        for m in _LAUNCH.finditer(path.read_text()):
            grid = tuple(int(g) for g in m.group(2, 3, 4))
            threads = int(m.group(5)) * int(m.group(6)) * int(m.group(7))
            launches[m.group(1)] = (grid, threads, int(m.group(8)))
    stats = []
    for path in sorted(dump.glob("*.ptx")):
        ptx = path.read_text()
        wanted = launches if xla_kernels else pallas
        if not any(name in wanted for name, _ in _entries(ptx)):
            continue  # only XLA's own kernels: no ptxas run for them
        usage = _ptxas_usage(path)
        for name, body in _entries(ptx):
            if name not in launches or name not in wanted:
                continue
            grid, threads, shared = launches[name]
            regs, stores, loads, stack = usage[name]
            f32_ops = len(re.findall(r"\b(?:fma|mul|add)\.rn(?:\.ftz)?\.f32\b", body))
            stats.append(KernelStats(name, regs, stores, loads, stack, shared, grid, threads,
                                     _mma_counts(body), f32_ops))
    return stats


def _ptxas_usage(path: Path) -> dict[str, tuple[int, int, int, int]]:
    """{entry: (registers, spill store bytes, spill load bytes, stack bytes)} from ptxas -v."""
    run = subprocess.run([str(ptxas()), f"-arch={ARCH}", "-v", str(path), "-o", os.devnull],
                         capture_output=True, text=True, check=True)
    usage, name, frame = {}, None, (0, 0, 0)
    for line in (run.stdout + run.stderr).splitlines():
        if m := re.search(r"Compiling entry function '([^']+)'", line):
            name = m.group(1)
        elif m := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, "
                            r"(\d+) bytes spill loads", line):
            frame = tuple(int(g) for g in m.groups())
        elif (m := re.search(r"Used (\d+) registers", line)) and name:
            stack, stores, loads = frame
            usage[name] = (int(m.group(1)), stores, loads, stack)
            name, frame = None, (0, 0, 0)
    return usage


def _entries(ptx: str):
    """(name, body) of each `.entry` in a PTX module."""
    starts = [(m.start(), m.group(1)) for m in re.finditer(r"\.entry (\w+)\(", ptx)]
    for i, (start, name) in enumerate(starts):
        end = starts[i + 1][0] if i + 1 < len(starts) else len(ptx)
        yield name, ptx[start:end]


def _mma_counts(body: str) -> dict:
    """Tensor-core instructions by kind and operand type: wgmma (Hopper) or mma.sync."""
    kinds = Counter()
    for m in re.finditer(r"\b(wgmma\.mma_async|mma\.sync)\S*?\.(bf16|f16|tf32|s8|e4m3)", body):
        kinds[f"{m.group(1).split('.')[0]}.{m.group(2)}"] += 1
    return dict(kinds)
