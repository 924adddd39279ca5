"""Compiles the CUDA backend's kernels (crates/model/src/cuda/kernels.cu) with NVRTC from
PyPI (nvidia-cuda-nvrtc, in the tools venv) as the backend does on a GPU — compute_90 PTX
with precise division and square roots — and then to an sm_90 cubin (ptxas), so a kernel
that does not compile fails on a machine without a GPU. Prints each kernel's registers and
any spills; exits non-zero with NVRTC's log on an error.

    python scripts/nvrtc-check.py crates/model/src/cuda/kernels.cu
"""

import ctypes
import glob
import os
import sys

import nvidia  # the namespace package the nvidia-* wheels install into


def libnvrtc():
    for root in nvidia.__path__:
        for path in sorted(glob.glob(os.path.join(root, "*", "lib", "libnvrtc.so.*"))):
            if "builtins" not in path:
                return ctypes.CDLL(path)
    sys.exit("libnvrtc not found: pip install nvidia-cuda-nvrtc (make deps does)")


def compile_source(lib, source, options):
    program = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(program), source, b"kernels.cu", 0, None, None):
        sys.exit("nvrtcCreateProgram failed")
    args = (ctypes.c_char_p * len(options))(*options)
    status = lib.nvrtcCompileProgram(program, len(options), args)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(program, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(program, log)
    lib.nvrtcDestroyProgram(ctypes.byref(program))
    return status, log.value.decode(errors="replace")


def main():
    source = open(sys.argv[1], "rb").read()
    lib = libnvrtc()
    precise = [b"--prec-div=true", b"--prec-sqrt=true"]
    status, log = compile_source(lib, source, [b"--gpu-architecture=compute_90", *precise])
    if status:
        sys.exit(f"NVRTC could not compile {sys.argv[1]} (compute_90):\n{log}")
    status, log = compile_source(lib, source, [b"--gpu-architecture=sm_90", b"-Xptxas=-v", *precise])
    if status:
        sys.exit(f"ptxas could not compile {sys.argv[1]} (sm_90):\n{log}")
    kernel = None
    for line in log.splitlines():
        if "Compiling entry function" in line:
            kernel = line.split("'")[1]
        elif "Used" in line and "registers" in line:
            print(f"{kernel}: {line.split(':', 1)[1].strip()}")
        elif "spill" in line and " 0 bytes spill stores, 0 bytes spill loads" not in line:
            print(f"{kernel}: SPILLS {line.replace('ptxas', '').strip(' .')}")
    print("kernels compile for sm_90")


if __name__ == "__main__":
    main()
