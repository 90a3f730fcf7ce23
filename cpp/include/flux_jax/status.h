// Status: the error type every layer below the FFI adapter returns.
//
// Kernels and backends never throw across layer boundaries and never see XLA
// types; the FFI adapter turns a failed Status into an ffi::Error.
#pragma once

#include <string>
#include <utility>

namespace flux_jax {

enum class StatusCode { kOk, kInvalidArgument, kDeadlineExceeded, kInternal, kResourceExhausted };

class Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return Status(); }
  static Status InvalidArgument(std::string m) { return {StatusCode::kInvalidArgument, std::move(m)}; }
  static Status DeadlineExceeded(std::string m) { return {StatusCode::kDeadlineExceeded, std::move(m)}; }
  static Status Internal(std::string m) { return {StatusCode::kInternal, std::move(m)}; }
  static Status ResourceExhausted(std::string m) { return {StatusCode::kResourceExhausted, std::move(m)}; }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

#define FLUX_JAX_RETURN_IF_ERROR(expr)           \
  do {                                           \
    ::flux_jax::Status _flux_status = (expr);    \
    if (!_flux_status.ok()) return _flux_status; \
  } while (0)

}  // namespace flux_jax
