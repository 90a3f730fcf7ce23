// Every FFI handler symbol the extension module registers (one per op of
// flux_jax/ops.def and platform).
#pragma once

#include "xla/ffi/api/api.h"

#define FLUX_JAX_OP(snake, Pascal) XLA_FFI_DECLARE_HANDLER_SYMBOL(FluxJax##Pascal##Cpu);
#include "flux_jax/ops.def"
#undef FLUX_JAX_OP

#ifdef FLUX_JAX_WITH_CUDA
#define FLUX_JAX_OP(snake, Pascal) XLA_FFI_DECLARE_HANDLER_SYMBOL(FluxJax##Pascal##Cuda);
#include "flux_jax/ops.def"
#undef FLUX_JAX_OP
#endif
