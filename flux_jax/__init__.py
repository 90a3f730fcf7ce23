"""flux_jax: tensor-parallel communication fused into GEMMs, for JAX.

FLUX (arXiv 2406.06858) as XLA FFI custom calls: AllGather -> GEMM and
GEMM -> ReduceScatter kernels whose tiles wait only for the rows they need, and
GEMM -> AllReduce for tensor parallelism without sequence parallelism.

Per-shard ops (inside jax.shard_map):
  flux_jax.ag_matmul(x, w, axis_name=..., impl="auto", return_gathered=False)
  flux_jax.matmul_rs(x, w, axis_name=..., impl="auto")
  flux_jax.matmul_ar(x, w, axis_name=..., impl="auto")
  flux_jax.column_matmul(x, w, axis_name=..., impl="auto")  (its backward is a fused matmul_ar)
  fp8=True / fp8=flux_jax.Fp8(...) on every op: FP8 operands, current scaling
  w=flux_jax.Fp8Weight.quantize(w, recipe): a weight quantized once (load time), for any op's w
Global-view helpers: flux_jax.<op>_sharded for each op above.
jax.export: disabled_checks=flux_jax.export_disabled_checks()
"""

from flux_jax import _native

_native.register()

from flux_jax._config import Config, config, get_config, set_config  # noqa: E402
from flux_jax._distributed import initialize as initialize_distributed  # noqa: E402
from flux_jax._errors import FusedUnavailableError  # noqa: E402
from flux_jax._explain import explain, explain_auto  # noqa: E402
from flux_jax._export import export_disabled_checks  # noqa: E402
from flux_jax._native import build_info  # noqa: E402
from flux_jax._state import HandlerHostTime, device_errors, handler_host_time, reset, workspace_bytes  # noqa: E402
from flux_jax.fp8 import Fp8, Fp8Weight  # noqa: E402
from flux_jax.ops import ag_matmul, column_matmul, matmul_ar, matmul_rs  # noqa: E402
from flux_jax.sharding import ag_matmul_sharded, column_matmul_sharded, matmul_ar_sharded, matmul_rs_sharded  # noqa: E402
from flux_jax.twins import ag_matmul_xla, column_matmul_xla, matmul_ar_xla, matmul_rs_xla  # noqa: E402

__version__ = build_info()["version"]


def __getattr__(name):
    if name == "tune":  # the tuning tool (python -m flux_jax.tune), imported when first used
        import importlib

        return importlib.import_module("flux_jax.tune")
    raise AttributeError(f"module 'flux_jax' has no attribute {name!r}")


__all__ = [
    "Config",
    "Fp8",
    "Fp8Weight",
    "FusedUnavailableError",
    "HandlerHostTime",
    "ag_matmul",
    "ag_matmul_sharded",
    "ag_matmul_xla",
    "build_info",
    "column_matmul",
    "column_matmul_sharded",
    "column_matmul_xla",
    "config",
    "device_errors",
    "explain",
    "explain_auto",
    "export_disabled_checks",
    "initialize_distributed",
    "get_config",
    "handler_host_time",
    "matmul_ar",
    "matmul_ar_sharded",
    "matmul_ar_xla",
    "matmul_rs",
    "matmul_rs_sharded",
    "matmul_rs_xla",
    "reset",
    "set_config",
    "workspace_bytes",
]
