"""jax.export of functions that call flux_jax ops.

jax.export refuses custom calls without JAX's compatibility guarantee unless the caller lists
them in `disabled_checks`; `export_disabled_checks()` lists flux_jax's. The guarantee is ours to
give instead, and it is narrow: the serialized program names flux_jax's FFI targets and their
attributes as this version lowers them, so the process that runs it must import flux_jax (which
registers the handlers) of the same version. Multi-platform exports (platforms=("cpu",
"cuda")) hold each call once per platform, each planned for its own (flux_jax/_lowering.py).
"""

from __future__ import annotations

from flux_jax import _native


def export_disabled_checks() -> list:
    """The `disabled_checks` jax.export needs for flux_jax's custom calls, one per FFI target:

        exported = jax.export.export(jax.jit(step), disabled_checks=flux_jax.export_disabled_checks())(*args)

    The program runs where flux_jax of the same version is imported (docs/design.md, "Export").
    """
    from jax import export

    return [export.DisabledSafetyCheck.custom_call(f"flux_jax_{op}") for op in _native.OPS]
