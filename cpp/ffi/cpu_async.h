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

#include <system_error>
#include <thread>
#include <utility>

#include "ffi_common.h"
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
  if (!decoded.ok()) return FailedFuture(decoded);
  ffi::Promise promise;
  ffi::Future future(promise);
  auto body = [promise, op, p, group, cfg, run]() mutable {
    Status s;
    {
      ScopedHandlerTimer timer(op);
      s = run(p, group, cfg);
    }
    if (s.ok()) {
      promise.SetAvailable();
    } else {
      promise.SetError(ToFfiError(s));
    }
  };
  try {
    std::thread(body).detach();
  } catch (const std::system_error&) {
    body();  // no thread to be had: wait here, as a blocking handler would
  }
  return future;
}

}  // namespace flux_jax::ffi_adapter
