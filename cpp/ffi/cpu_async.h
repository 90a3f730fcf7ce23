// CPU handlers run a call's protocol on a thread of its own and hand XLA a future.
//
// A CPU call waits for its peers (other devices' threads, or processes). Waiting on one of
// XLA:CPU's threads let a program of many independent fused calls exhaust them: each device
// could be waiting in a call whose peers' threads were all held by other waiting calls, until
// the timeout (measured: 32 independent calls at TP 8 on a 2-core host). XLA keeps the call's
// buffers alive until the future completes; the handler decodes them before it returns.
//
//   XLA:CPU thread          own thread
//   decode -> spawn ------> run the protocol (wait for peers, GEMM, agree) -> promise
//   return future           (no XLA thread held meanwhile)
#pragma once

#include <exception>
#include <string>
#include <thread>
#include <utility>

#include "ffi_common.h"
#include "flux_jax/cpu_channels.h"
#include "handler_stats.h"

namespace flux_jax::ffi_adapter {

inline ffi::Future FailedFuture(const Status& s) {
  ffi::Promise promise;
  ffi::Future future(promise);
  promise.SetError(ToFfiError(s));
  return future;
}

// A CPU handler's tail: `decoded` is its decode's Status (an error fails the future at once),
// `p`, `group` and `cfg` what it decoded, `run` the backend (RunAgMatmulCpu, ...). The thread
// holds copies of them, no FFI views.
template <typename Params>
ffi::Future RunOnOwnThread(HandlerOp op, const Status& decoded, const Params& p, const TpGroup& group,
                           const CommConfig& cfg, Status (*run)(const Params&, const TpGroup&, const CommConfig&)) {
  if (!decoded.ok()) {
    // A rank that resolved its group but cannot run the call: its peers must not wait for it.
    if (!group.devices.empty()) FailCpuCallSite(group, cfg.callsite, decoded);
    return FailedFuture(decoded);
  }
  ffi::Promise promise;
  ffi::Future future(promise);
  const std::string where = "flux_jax (cpu backend): rank " + std::to_string(group.rank) + " of " + group.Describe() +
                            ", call site " + std::to_string(cfg.callsite) + ": ";
  auto body = [promise, op, p, group, cfg, run, where]() mutable {
    Status s;
    {
      ScopedHandlerTimer timer(op);
      // Nothing may leave this frame: an exception on a detached thread ends the process. The
      // call's channel, unwound, has told the peers already (ChannelCall: Abandon).
      try {
        s = run(p, group, cfg);
      } catch (const std::exception& e) {
        s = Status::Internal(where + e.what());
      } catch (...) {
        s = Status::Internal(where + "an unknown exception");
      }
    }
    if (s.ok()) {
      promise.SetAvailable();
    } else {
      promise.SetError(ToFfiError(s));
    }
  };
  // No thread, no call: waiting on XLA's thread instead could hold the thread a peer's call needs.
  // The peers time out on this rank; its error names the cause.
  try {
    std::thread(body).detach();
  } catch (const std::exception& e) {
    promise.SetError(ToFfiError(Status::ResourceExhausted(where + "could not start a thread for the call (" + e.what() +
                                                          "): raise the process's thread or memory limits")));
  }
  return future;
}

}  // namespace flux_jax::ffi_adapter
