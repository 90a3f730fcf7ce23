// Process-wide state of the CPU backend, exposed for tests and flux_jax.reset().
#pragma once

#include <cstddef>
#include <cstdint>

#include "flux_jax/params.h"
#include "flux_jax/status.h"

namespace flux_jax {

// Fails the call site's channel of `group` with `error`, for a rank that cannot start the call
// (its decode failed after its group resolved, e.g. lax.axis_index disagrees with the mesh
// table): peers that are waiting get `error` at once, and peers that come later get it when
// they open the channel, instead of timing out on this rank. Until flux_jax.reset().
void FailCpuCallSite(const TpGroup& group, int64_t callsite, const Status& error);

// Drops every CPU channel (and with it any failed state). Only call when no
// fused CPU op is running.
void ResetCpuChannels();

// Number of live CPU channels (one per fused call site and TP group).
size_t CpuChannelCount();

}  // namespace flux_jax
