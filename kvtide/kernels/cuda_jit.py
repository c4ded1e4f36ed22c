"""Compile CUDA C++ kernels at run time (NVRTC) and launch them (CUDA driver API), through ctypes.

Why this instead of torch.utils.cpp_extension: that needs nvcc, a host compiler and ninja where kvtide runs and
takes about a minute per build; NVRTC comes with every CUDA build of torch (``nvidia-cuda-nvrtc`` wheels) and
compiles one kernel in about a second, no host code involved. Why not ``torch.cuda._compile_kernel``: private,
and it passes Python floats as doubles. A launch here costs a few microseconds of Python (no per-call
specialisation), runs on torch's current stream and is captured by CUDA graphs like any other launch.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
import sys
from dataclasses import dataclass, field

import torch

_NVRTC_NAMES = ("libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so")


class CudaJitError(RuntimeError):
    """NVRTC or the driver refused: the message carries the compiler log or the driver's error name."""


@functools.cache
def nvrtc() -> ctypes.CDLL:
    """The NVRTC library: ``KVTIDE_NVRTC`` if set, else the system's, else one from an nvidia-* wheel."""
    cands = [os.environ["KVTIDE_NVRTC"]] if os.environ.get("KVTIDE_NVRTC") else []
    cands += list(_NVRTC_NAMES)
    for base in sys.path:
        cands += sorted(glob.glob(os.path.join(base, "nvidia", "*", "lib", "libnvrtc.so*")), reverse=True)
    errors = []
    for name in cands:
        if "builtins" in name or ".alt." in name:
            continue
        try:
            lib = ctypes.CDLL(name)
        except OSError as e:
            errors.append(str(e))
            continue
        lib.nvrtcCreateProgram.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p, ctypes.c_char_p,
                                           ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        lib.nvrtcCompileProgram.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        for fn in ("nvrtcGetProgramLogSize", "nvrtcGetCUBINSize"):
            getattr(lib, fn).argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)]
        for fn in ("nvrtcGetProgramLog", "nvrtcGetCUBIN"):
            getattr(lib, fn).argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        lib.nvrtcDestroyProgram.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        return lib
    raise CudaJitError("NVRTC not found (tried KVTIDE_NVRTC, libnvrtc.so.13/.12 and nvidia-* wheels on sys.path): "
                       "install the nvidia-cuda-nvrtc wheel matching your CUDA, or set KVTIDE_NVRTC to the library")


def compile_cubin(source: str, name: str, arch: int, defines: dict[str, int] | None = None,
                  options: tuple[str, ...] = ()) -> tuple[bytes, str]:
    """(cubin for sm_<arch>, compiler log). Runs on any machine with NVRTC; no GPU needed."""
    lib = nvrtc()
    prog = ctypes.c_void_p()
    _nvrtc_check(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{name}.cu".encode(), 0, None,
                                             None), "create")
    opts = [f"--gpu-architecture=sm_{arch}", "--std=c++17", "--ptxas-options=-v", *options]
    opts += [f"-D{k}={v}" for k, v in (defines or {}).items()]
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    try:
        res = lib.nvrtcCompileProgram(prog, len(opts), arr)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, buf)
        log = buf.value.decode(errors="replace")
        if res != 0:
            raise CudaJitError(f"NVRTC could not compile {name} ({' '.join(opts)}):\n{log}")
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        cubin = ctypes.create_string_buffer(size.value)
        _nvrtc_check(lib, lib.nvrtcGetCUBIN(prog, cubin), "get cubin")
        return cubin.raw, log
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _nvrtc_check(lib: ctypes.CDLL, res: int, what: str) -> None:
    if res != 0:
        raise CudaJitError(f"NVRTC {what} failed: {lib.nvrtcGetErrorString(res).decode()}")


class _LaunchAttr(ctypes.Structure):  # CUlaunchAttribute: id, padding, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_char * 64)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("smem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttr)), ("num_attrs", ctypes.c_uint)]


_PDL_ATTR = _LaunchAttr(6, b"", (1).to_bytes(4, "little"))  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 1


@functools.cache
def driver() -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise CudaJitError(f"the CUDA driver library libcuda.so.1 cannot be loaded: {e}") from e
    lib.cuModuleLoadData.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p]
    lib.cuModuleGetFunction.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_char_p]
    lib.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p,
                                                                               ctypes.POINTER(ctypes.c_void_p),
                                                                               ctypes.c_void_p]
    lib.cuCtxGetCurrent.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
    lib.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
    lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
    lib.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
    lib.cuFuncGetAttribute.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_void_p]
    lib.cuFuncSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                                     ctypes.c_void_p]
    lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    return lib


def _check(res: int, what: str) -> None:
    if res != 0:
        name = ctypes.c_char_p()
        driver().cuGetErrorName(res, ctypes.byref(name))
        raise CudaJitError(f"CUDA driver call {what} failed: {(name.value or b'?').decode()} ({res})")


@functools.cache
def _primary_context(device: int) -> ctypes.c_void_p:
    """torch's context for ``device`` (the primary one), retained once; made current where a thread has none."""
    torch.cuda.init()
    dev = ctypes.c_int()
    _check(driver().cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
    ctx = ctypes.c_void_p()
    _check(driver().cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    return ctx


def _ensure_context(device: int) -> None:
    cur = ctypes.c_void_p()
    _check(driver().cuCtxGetCurrent(ctypes.byref(cur)), "cuCtxGetCurrent")
    want = _primary_context(device)
    if cur.value != want.value:
        _check(driver().cuCtxSetCurrent(want), "cuCtxSetCurrent")


@dataclass
class Kernel:
    """One loaded kernel; ``launch`` takes tensors (by pointer), ints (C int) and floats (C float)."""

    name: str
    device: int
    func: ctypes.c_void_p
    num_regs: int
    local_bytes: int
    _module: ctypes.c_void_p = field(repr=False)
    _smem_allowed: int = field(default=0, repr=False)

    def launch(self, grid: tuple[int, int, int], block: int, args: list,
               stream: torch.cuda.Stream | None = None, smem: int = 0, pdl: bool = False) -> None:
        """``smem``: bytes of dynamic shared memory, allowed to the kernel once per larger size (the driver refuses
        more than 48 KB of static plus dynamic shared memory without it). ``pdl``: programmatic dependent launch
        (sm_90+): the kernel may be scheduled while the previous one in the stream drains, so it must execute
        ``griddepcontrol.wait`` before touching anything that kernel wrote."""
        _ensure_context(self.device)
        if smem > self._smem_allowed:
            _check(driver().cuFuncSetAttribute(self.func, 8, smem),  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
                   f"cuFuncSetAttribute({self.name}, {smem} bytes of shared memory)")
            self._smem_allowed = smem
        cargs = []
        for a in args:
            if isinstance(a, torch.Tensor):
                cargs.append(ctypes.c_void_p(a.data_ptr()))
            elif isinstance(a, bool):
                cargs.append(ctypes.c_int(int(a)))
            elif isinstance(a, int):
                cargs.append(ctypes.c_int(a))
            elif isinstance(a, float):
                cargs.append(ctypes.c_float(a))
            else:
                raise TypeError(f"kernel {self.name}: unsupported argument type {type(a).__name__}")
        params = (ctypes.c_void_p * len(cargs))(*[ctypes.cast(ctypes.byref(c), ctypes.c_void_p) for c in cargs])
        s = stream if stream is not None else torch.cuda.current_stream(self.device)
        if pdl:
            cfg = _LaunchConfig((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(block, 1, 1), smem,
                                ctypes.c_void_p(s.cuda_stream), ctypes.pointer(_PDL_ATTR), 1)
            _check(driver().cuLaunchKernelEx(ctypes.byref(cfg), self.func, params, None),
                   f"cuLaunchKernelEx({self.name}, programmatic dependent launch)")
            return
        _check(driver().cuLaunchKernel(self.func, grid[0], grid[1], grid[2], block, 1, 1, smem,
                                       ctypes.c_void_p(s.cuda_stream), params, None), f"cuLaunchKernel({self.name})")


def load(cubin: bytes, names: list[str], device: int) -> dict[str, Kernel]:
    """Load a cubin into ``device``'s primary context and look up its kernels."""
    _ensure_context(device)
    mod = ctypes.c_void_p()
    _check(driver().cuModuleLoadData(ctypes.byref(mod), cubin), "cuModuleLoadData")
    out = {}
    for name in names:
        f = ctypes.c_void_p()
        _check(driver().cuModuleGetFunction(ctypes.byref(f), mod, name.encode()), f"cuModuleGetFunction({name})")
        regs, local = ctypes.c_int(), ctypes.c_int()
        driver().cuFuncGetAttribute(ctypes.byref(regs), 4, f)  # CU_FUNC_ATTRIBUTE_NUM_REGS
        driver().cuFuncGetAttribute(ctypes.byref(local), 3, f)  # CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES
        out[name] = Kernel(name, device, f, regs.value, local.value, mod)
    return out


_NUDGE_SOURCE = r"""
extern "C" __global__ void kvtide_pdl_nudge(int* x) { if (threadIdx.x == 0) x[blockIdx.x] += 1; }
"""


@functools.cache
def _nudge(device: int) -> tuple[Kernel, torch.Tensor]:
    major, minor = torch.cuda.get_device_capability(device)
    cubin, _ = compile_cubin(_NUDGE_SOURCE, "kvtide_pdl_nudge", major * 10 + minor)
    return load(cubin, ["kvtide_pdl_nudge"], device)["kvtide_pdl_nudge"], torch.zeros(1, dtype=torch.int32,
                                                                                       device=f"cuda:{device}")


def pdl_nudge(device: int) -> None:
    """Launch a one-thread kernel as a programmatic dependent launch on the current stream. Why: an eager launch
    with that attribute takes the process out of a state in which graph-replayed kernels idle longer between one
    another (docs/design/kernel.md); see ``kvtide.engine.cuda_graphs.PDL_NUDGE``."""
    k, x = _nudge(device)
    k.launch((1, 1, 1), 32, [x], pdl=True)
