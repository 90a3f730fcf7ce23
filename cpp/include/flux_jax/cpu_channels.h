// Process-wide state of the CPU backend, exposed for tests and flux_jax.reset().
#pragma once

#include <cstddef>

namespace flux_jax {

// Drops every CPU channel (and with it any failed state). Only call when no
// fused CPU op is running.
void ResetCpuChannels();

// Number of live CPU channels (one per fused call site and TP group).
size_t CpuChannelCount();

}  // namespace flux_jax
