// common.h: errors, bf16 conversion, small helpers shared by every part of the core.
#pragma once
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace lily {

// Bad input from the user (a file, a tensor, a config field, a prompt): Python sees ValueError.
struct InputError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

// Message formatting without iostreams (they are not needed, and a module that links its own C++ runtime may
// leave their locale uninitialised).
inline std::string to_text(const std::string& s) { return s; }
inline std::string to_text(const char* s) { return s; }
inline std::string to_text(char c) { return std::string(1, c); }
template <typename T>
std::string to_text(const T& v) {
  if constexpr (std::is_same_v<T, bool>) {
    return v ? "true" : "false";
  } else if constexpr (std::is_integral_v<T>) {
    return std::to_string(v);
  } else {
    static_assert(std::is_floating_point_v<T>, "to_text: unsupported type");
    char buf[32];
    std::snprintf(buf, sizeof buf, "%g", double(v));
    return buf;
  }
}

template <typename... Args>
std::string cat(const Args&... args) {
  std::string s;
  (s += ... += to_text(args));
  return s;
}

#define LILY_CHECK(cond, ...) \
  do { if (!(cond)) throw ::lily::InputError(::lily::cat(__VA_ARGS__)); } while (0)
#define LILY_ASSERT(cond, ...) \
  do { if (!(cond)) throw std::logic_error(::lily::cat(__FILE__, ":", __LINE__, ": ", __VA_ARGS__)); } while (0)

inline float bf16_to_f32(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even, NaN kept quiet.
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace lily
