// Two kinds of failure, as in PyTorch's c10 (TORCH_CHECK vs TORCH_INTERNAL_ASSERT):
//  - UserError: the user can fix it (bad recipe, missing file, budget too small). Shown without
//    a stack trace; apps/ turns it into exit code 2.
//  - InternalError: a broken invariant of titan3d itself (a bug). apps/ exits 1.
// Library code throws; only apps/ decides exit codes.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace t3d {

struct UserError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A GEMM kind this CPU or library cannot run: what() is the whole message with the advice for a
// user who asked for that kind; reason() alone says why, for a caller that chose it itself.
struct GemmUnavailable : UserError {
  GemmUnavailable(const std::string& reason, const std::string& advice)
      : UserError(reason + ". " + advice), reason_(reason) {}
  const std::string& reason() const { return reason_; }

 private:
  std::string reason_;
};

struct InternalError : std::logic_error {
  using std::logic_error::logic_error;
};

namespace detail {
template <typename... Args>
std::string concat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
}  // namespace detail

}  // namespace t3d

// T3D_USER_CHECK(cond, "message parts", ...): throws UserError with the message.
#define T3D_USER_CHECK(cond, ...)                                            \
  do {                                                                       \
    if (!(cond)) throw ::t3d::UserError(::t3d::detail::concat(__VA_ARGS__)); \
  } while (0)

// T3D_ASSERT(cond, ...): internal invariant; message carries file:line.
#define T3D_ASSERT(cond, ...)                                                           \
  do {                                                                                  \
    if (!(cond))                                                                        \
      throw ::t3d::InternalError(::t3d::detail::concat(                                 \
          __FILE__, ":", __LINE__, ": assertion `" #cond "` failed. ", ##__VA_ARGS__)); \
  } while (0)
