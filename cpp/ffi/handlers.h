// Every FFI handler symbol the extension module registers.
#pragma once

#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(FluxJaxAgMatmulCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FluxJaxMatmulRsCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FluxJaxAllGatherCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FluxJaxReduceScatterCpu);
#ifdef FLUX_JAX_WITH_CUDA
XLA_FFI_DECLARE_HANDLER_SYMBOL(FluxJaxAgMatmulCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FluxJaxMatmulRsCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FluxJaxAllGatherCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FluxJaxReduceScatterCuda);
#endif
