// Resolving "which TP group am I in, and which rank" on the device side.
//
// The Python lowering flattens the mesh into a table of device ordinals,
// table[g * tp + r] = ordinal of rank r in group g. Every device runs the same
// HLO, so the table is the same everywhere; each device finds itself in it and
// cross-checks its position against lax.axis_index (passed as an operand).
#pragma once

#include <cstdint>
#include <optional>

#include "flux_jax/params.h"
#include "flux_jax/process.h"
#include "flux_jax/status.h"

namespace flux_jax {

// `devices` holds global device ids and `processes` their process indices (the
// same layout). `position_operand` is the device's place in that table by the
// program's lax.axis_index, g * tp + r (g: the index over the mesh's other
// axes, r: over the TP axes), or nullopt when it cannot be read on the host
// (GPU: it lives in device memory).
Status ResolveTpGroup(const int64_t* devices, const int64_t* processes, size_t table_size, int64_t tp_size,
                      Platform platform, int32_t device_ordinal, std::optional<int32_t> position_operand,
                      TpGroup* group);

}  // namespace flux_jax
