"""Loads the native extension and registers its FFI targets with JAX."""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import sys
import warnings

import jax


def _differing_sources(checkout_dir: str, installed_dir: str) -> list[str]:
    """The .py files of the installed package whose text differs from the checkout's."""
    differing = []
    for name in sorted(os.listdir(installed_dir)):
        mine = os.path.join(checkout_dir, name)
        if not name.endswith(".py") or not os.path.isfile(mine):
            continue
        with open(mine, "rb") as a, open(os.path.join(installed_dir, name), "rb") as b:
            if a.read() != b.read():
                differing.append(name)
    return differing


def _load_installed_extension():
    """The extension of an installed flux_jax, when this package is the source checkout.

    Running a script from the repository root (`python -m benchmarks.run`) puts the source
    directory first on sys.path; it has no compiled extension, so look for the one that
    `pip install .` put in site-packages and load it under our name.
    """
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        candidate_dir = os.path.join(os.path.abspath(entry or "."), "flux_jax")
        if candidate_dir == here or not os.path.isdir(candidate_dir):
            continue
        for name in sorted(os.listdir(candidate_dir)):
            if name.startswith("_flux_jax_ffi.") and name.endswith((".so", ".pyd")):
                spec = importlib.util.spec_from_file_location(
                    "flux_jax._flux_jax_ffi", os.path.join(candidate_dir, name)
                )
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
                sys.modules["flux_jax._flux_jax_ffi"] = module
                differing = _differing_sources(here, candidate_dir)
                if differing:  # e.g. another branch's wheel under this checkout's Python
                    warnings.warn(
                        f"flux_jax: running the Python of {here} with the extension installed in "
                        f"{candidate_dir}, whose Python differs ({', '.join(differing[:3])}"
                        f"{', ...' if len(differing) > 3 else ''}): they may not belong together; "
                        "install this checkout (pip install .) or run from outside it",
                        stacklevel=2,
                    )
                return module
    return None


try:
    from flux_jax import _flux_jax_ffi as _ext
except ImportError as e:
    _ext = _load_installed_extension()
    if _ext is None:
        raise ImportError(
            "flux_jax's native extension (_flux_jax_ffi) is missing. Install the package with "
            "`pip install .` (or `pip install -e . --no-build-isolation` for development); a "
            "source checkout without a built or installed extension does not work."
        ) from e

# The custom calls of the extension (cpp/include/flux_jax/ops.def); FFI target "flux_jax_<op>".
OPS: tuple[str, ...] = tuple(_ext.ops())
# Ops with CUDA kernels in this build.
_CUDA_KERNELS: tuple[str, ...] = tuple(getattr(_ext, "cuda_kernels", lambda: ())())


def _version_tuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits or 0))
    return tuple(out)


def _require_eager_module_loading() -> None:
    """Make CUDA load every kernel when a module loads, not at its first launch.

    With lazy loading (CUDA's default) the first launch of any kernel (ours,
    XLA's, cuBLAS's) waits for the device to go idle. A fused op's waits depend
    on the peer GPU's host thread making progress; if that thread is stuck in a
    lazy load behind our waiting kernels, both sides stall until the timeout.
    Measured on 2x H200: the GPU test suite failed this way with lazy loading
    and passed (28/28) with CUDA_MODULE_LOADING=EAGER. The variable must be set
    before CUDA initializes, so we set it on import unless the user chose.
    """
    if os.environ.get("CUDA_MODULE_LOADING", "").upper() == "EAGER":
        return
    if "CUDA_MODULE_LOADING" in os.environ:
        warnings.warn(
            f"CUDA_MODULE_LOADING={os.environ['CUDA_MODULE_LOADING']}: flux_jax's fused GPU ops can "
            "stall until their timeout on the first launch of a kernel; use CUDA_MODULE_LOADING=EAGER.",
            RuntimeWarning,
            stacklevel=3,
        )
        return
    from jax._src import xla_bridge  # private: the only way to know if backends exist yet

    if getattr(xla_bridge, "_backends", None):
        if any(getattr(b, "platform", "") == "gpu" for b in xla_bridge._backends.values()):
            warnings.warn(
                "flux_jax was imported after JAX initialized the GPU, so CUDA_MODULE_LOADING=EAGER "
                "could not take effect; fused GPU ops may stall on a kernel's first launch. Import "
                "flux_jax before using the GPU, or export CUDA_MODULE_LOADING=EAGER.",
                RuntimeWarning,
                stacklevel=3,
            )
        return
    os.environ["CUDA_MODULE_LOADING"] = "EAGER"


@functools.cache
def register() -> None:
    """Registers every handler the extension provides (idempotent)."""
    if _ext.build_info()["cuda"]:
        _require_eager_module_loading()
    headers = _ext.build_info()["jaxlib_headers"]
    runtime = importlib.metadata.version("jaxlib")
    if _version_tuple(runtime) < _version_tuple(headers):
        raise ImportError(
            f"flux_jax was built against the FFI headers of jaxlib {headers} but jaxlib {runtime} "
            "is installed; a handler built with newer headers breaks an older runtime. Upgrade "
            f"jaxlib to >= {headers} or rebuild flux_jax against this jaxlib."
        )
    for platform, targets in _ext.registrations().items():
        for name, capsule in targets.items():
            jax.ffi.register_ffi_target(name, capsule, platform=platform)


def build_info() -> dict:
    """What this flux_jax build contains.

    Keys: version, cuda (bool), cuda_archs, cuda_version, cutlass_version,
    cuda_kernels (ops with real CUDA kernels), ffi_api_version, jaxlib_headers
    (the jaxlib whose FFI headers the extension was compiled against), jax and
    jaxlib (the runtime versions).
    """
    info = dict(_ext.build_info())
    info["cuda_kernels"] = _CUDA_KERNELS
    info["jax"] = jax.__version__
    info["jaxlib"] = importlib.metadata.version("jaxlib")
    return info


def has_cuda_kernel(op: str) -> bool:
    return bool(_ext.build_info()["cuda"]) and op in _CUDA_KERNELS


def extension():
    return _ext
