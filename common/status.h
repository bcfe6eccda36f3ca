// Status helpers shared by every qcal module.
//
// Functions that can fail on input, I/O or the environment return absl::Status or
// absl::StatusOr<T>. abseil's status codes are gRPC's codes; the RPC edge converts them in one
// place (rpc/grpc_status.h). Debian's abseil (20220623) has no RETURN_IF_ERROR macros,
// so qcal defines its own here.
//
// Note: Debian's abseil is built with its own absl::string_view (not std::string_view), so pass
// std::string or const char* (or absl::string_view) to absl::StrCat and absl::Status.
#pragma once

#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace qcal {

using absl::Status;
using absl::StatusOr;

// Returns `status` with `context` prepended to its message ("context: message"), keeping the code.
inline Status Annotate(const Status& status, absl::string_view context) {
  if (status.ok()) return status;
  return Status(status.code(), absl::StrCat(context, ": ", status.message()));
}

}  // namespace qcal

#define QCAL_STATUS_CONCAT_INNER_(a, b) a##b
#define QCAL_STATUS_CONCAT_(a, b) QCAL_STATUS_CONCAT_INNER_(a, b)

// Evaluates `expr` (an absl::Status) and returns it from the current function if it is not OK.
#define QCAL_RETURN_IF_ERROR(expr)                                  \
  do {                                                              \
    ::absl::Status qcal_status_ = (expr);                           \
    if (!qcal_status_.ok()) return qcal_status_;                    \
  } while (0)

// QCAL_ASSIGN_OR_RETURN(auto x, FunctionReturningStatusOr());
// Evaluates the StatusOr, returns its status on error, otherwise moves the value into `lhs`.
#define QCAL_ASSIGN_OR_RETURN(lhs, expr) \
  QCAL_ASSIGN_OR_RETURN_IMPL_(QCAL_STATUS_CONCAT_(qcal_statusor_, __LINE__), lhs, expr)
#define QCAL_ASSIGN_OR_RETURN_IMPL_(var, lhs, expr) \
  auto var = (expr);                                \
  if (!var.ok()) return std::move(var).status();    \
  lhs = std::move(var).value()
