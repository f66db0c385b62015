"""The CUDA C kernels in cuda/: they compile (nvcc --ptx), keep the exactness contract, and ship.

No GPU is needed: nvcc only translates to PTX. Where nvcc is absent those tests skip and say so.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from commopt.kernels.cuda_sources import CUDA_HEADERS, CUDA_SOURCES, cuda_source, cuda_source_dir

REPO = Path(__file__).resolve().parents[2]
NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH; cannot compile .cu")

# extern "C" entry points the Python side (commopt/kernels/cupy_kernels.py) launches, per file.
ENTRIES = {
    "worker.cu": {
        "commopt_compensate",
        "commopt_scale",
        "commopt_finish_rms",
        "commopt_pack_update",
        "commopt_pack_compensated",
    },
    "server.cu": {"commopt_server_average"},
    "unpack.cu": {"commopt_unpack_scaled"},
}


def test_every_source_is_known_and_found():
    on_disk = sorted(p.name for p in (REPO / "cuda").glob("*.cu"))
    assert on_disk == sorted(CUDA_SOURCES), (
        "a .cu file in cuda/ is not in CUDA_SOURCES or vice versa"
    )
    headers = sorted(p.name for p in (REPO / "cuda").glob("*.cuh"))
    assert headers == sorted(CUDA_HEADERS), "a .cuh file in cuda/ is not in CUDA_HEADERS"
    assert sorted(ENTRIES) == sorted(CUDA_SOURCES)
    assert cuda_source_dir() == REPO / "cuda"  # this checkout is installed editable


def test_headers_are_pasted_in_place_of_their_include_line():
    headers = {h: (REPO / "cuda" / h).read_text() for h in CUDA_HEADERS}
    for name in CUDA_SOURCES:
        raw = (REPO / "cuda" / name).read_text()
        text = cuda_source(name)
        assert not re.search(r"^\s*#\s*include", text, re.MULTILINE), name  # no include path
        expect = raw
        for header, body in headers.items():
            expect = expect.replace(f'#include "{header}"', body, 1)
        assert text == expect, name
    # the reducing sources share the one reduction helper instead of each defining its own, and
    # every source the one vector-access helper
    for name in ("worker.cu", "server.cu"):
        assert cuda_source(name).count("__device__ double commopt_block_sum(") == 1
    for name in CUDA_SOURCES:
        assert cuda_source(name).count("__device__ __forceinline__ float4 commopt_load4(") == 1


def test_an_unknown_include_is_rejected(tmp_path, monkeypatch):
    for name in CUDA_SOURCES:
        (tmp_path / name).write_text('#include "elsewhere.h"\n')
    monkeypatch.setattr("commopt.kernels.cuda_sources.cuda_source_dir", lambda: tmp_path)
    with pytest.raises(ValueError, match=r"worker.cu includes 'elsewhere.h', not one of"):
        cuda_source("worker.cu")


def test_unknown_source_name_is_rejected():
    with pytest.raises(ValueError, match=r"unknown CUDA source 'nope.cu'; expected one of"):
        cuda_source("nope.cu")


def test_every_entry_point_is_launched_from_python():
    wrapper = (REPO / "commopt" / "kernels" / "cupy_kernels.py").read_text()
    for entries in ENTRIES.values():
        for entry in entries:
            assert f'"{entry}"' in wrapper, entry


@needs_nvcc
@pytest.mark.parametrize("name", CUDA_SOURCES)
@pytest.mark.parametrize("arch", [None, "sm_90"])  # nvcc's default (oldest supported), Hopper
def test_compiles_to_ptx_without_warnings(name, arch, tmp_path):
    """nvcc --ptx -Werror all-warnings on the text CuPy compiles (``cuda_source``); the PTX has
    the entry points and no fp32 FMA.

    An fp32 FMA would mean a multiply and an add were contracted into one rounding, which breaks
    the bit-for-bit agreement with the CPU kernels (the sources use __f*_rn intrinsics to
    prevent it). fp64 FMAs in the sums of squares are fine: d·d is exact in fp64.
    """
    ptx = tmp_path / f"{name}.ptx"
    source = tmp_path / name  # no include path: the headers must already be pasted in
    source.write_text(cuda_source(name))
    proc = subprocess.run(
        [
            NVCC,
            "--ptx",
            *([f"-arch={arch}"] if arch else []),
            "-Werror",
            "all-warnings",
            "-o",
            str(ptx),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    text = ptx.read_text()
    entries = set(re.findall(r"\.entry\s+(\w+)", text))
    assert entries == ENTRIES[name]
    assert "fma.rn.f32" not in text and "mad.f32" not in text


def test_wheel_ships_the_cuda_sources(tmp_path):
    """Build a wheel from a copy of the project; it must carry commopt/cuda/*.cu, found there."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md"):
        if (REPO / name).exists():
            shutil.copy2(REPO / name, src / name)
    shutil.copytree(REPO / "commopt", src / "commopt", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "cuda", src / "cuda")
    wheels = tmp_path / "wheels"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(src),
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(wheels),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    (wheel,) = wheels.glob("commopt-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        for name in (*CUDA_SOURCES, *CUDA_HEADERS):
            assert zf.read(f"commopt/cuda/{name}").decode() == (REPO / "cuda" / name).read_text()
        zf.extractall(tmp_path / "site")
    # Installed from the wheel (first on sys.path), the sources are looked up inside the package.
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "from commopt.kernels.cuda_sources import cuda_source_dir; print(cuda_source_dir())",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(tmp_path / "site"), "PATH": "/usr/bin:/bin"},
        cwd=tmp_path,  # not the checkout: `python -c` puts the working directory first on sys.path
    )
    assert proc.returncode == 0, proc.stderr
    assert Path(proc.stdout.strip()) == tmp_path / "site" / "commopt" / "cuda"


# -- NVRTC, the compiler CuPy uses, and ptxas: NVIDIA's own tools, no GPU needed -----------------
def _nvidia_path(package: str, *parts: str) -> Path | None:
    """A file of an ``nvidia-*`` wheel (the ``nvrtc`` extra), or None where it is not installed."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(f"nvidia.{package}")
    except ModuleNotFoundError:
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations)), *parts)
    return path if path.exists() else None


NVRTC = _nvidia_path("cuda_nvrtc", "lib", "libnvrtc.so.12")
PTXAS = _nvidia_path("cuda_nvcc", "bin", "ptxas")


def _nvrtc_ptx(source: str, name: str, arch: str) -> tuple[str, str]:
    """(PTX, compile log) of ``source`` through NVRTC, as CuPy's RawModule compiles it."""
    import ctypes

    lib = ctypes.CDLL(str(NVRTC))
    prog = ctypes.c_void_p()
    assert (
        lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None)
        == 0
    )
    options = [f"--gpu-architecture=compute_{arch}".encode()]
    status = lib.nvrtcCompileProgram(prog, len(options), (ctypes.c_char_p * len(options))(*options))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    assert status == 0, log.value.decode()
    lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
    ptx = ctypes.create_string_buffer(size.value)
    assert lib.nvrtcGetPTX(prog, ptx) == 0
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return ptx.value.decode(), log.value.decode().strip()


@pytest.mark.skipif(NVRTC is None or PTXAS is None, reason="the nvrtc extra is not installed")
@pytest.mark.parametrize("name", CUDA_SOURCES)
@pytest.mark.parametrize("arch", ["75", "90"])  # the oldest NVRTC 12.9 does not deprecate; Hopper
def test_nvrtc_compiles_and_ptxas_assembles_every_source(name, arch, tmp_path):
    """The exact text CuPy compiles, through NVRTC: no warning, every entry point, no fp32 FMA
    (it would break the bit-for-bit contract), the 16-byte vector accesses of vector4.cuh, and
    ptxas assembles it for the GPU with no register spills."""
    ptx, log = _nvrtc_ptx(cuda_source(name), name, arch)
    assert log == "", log
    assert set(re.findall(r"\.entry\s+(\w+)", ptx)) == ENTRIES[name]
    assert "fma.rn.f32" not in ptx and "mad.f32" not in ptx
    assert re.search(r"st\.global\.v4\.f32", ptx), "no 16-byte vector store"
    (tmp_path / f"{name}.ptx").write_text(ptx)
    ptx_file, cubin = tmp_path / f"{name}.ptx", tmp_path / f"{name}.cubin"
    proc = subprocess.run(
        [str(PTXAS), f"-arch=sm_{arch}", "-v", "-Werror", str(ptx_file), "-o", str(cubin)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    spills = re.findall(r"(\d+) bytes spill stores", proc.stderr)
    assert spills and all(s == "0" for s in spills), proc.stderr
