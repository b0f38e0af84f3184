// mapped_files.cpp: the registry and the SIGBUS handler (mapped_files.h). The handler uses only async-signal-safe
// calls (write, sigaction, raise) and reads the registry through atomics; every message is formatted at
// registration time.
#include "core/mapped_files.h"

#include <atomic>
#include <cstdint>
#include <cstring>
#include <mutex>

#if defined(__unix__) || defined(__APPLE__)
#include <signal.h>
#include <unistd.h>
#define LILY_HAS_SIGBUS_HANDLER 1
#endif

namespace lily {
namespace {

struct Slot {
  std::atomic<bool> used{false};
  std::atomic<uintptr_t> begin{0}, end{0};
  char message[512] = {};
  size_t length = 0;
};

Slot g_slots[kMaxMappedFiles];
std::mutex g_mutex;  // registration and removal; never taken by the handler

#ifdef LILY_HAS_SIGBUS_HANDLER
struct sigaction g_previous;

// A SIGBUS outside the registered mappings is not Lily's: it passes to the previous disposition unremarked.
void on_sigbus(int sig, siginfo_t* info, void*) {
  const uintptr_t at = uintptr_t(info->si_addr);
  for (const Slot& s : g_slots) {
    if (s.used.load(std::memory_order_acquire) && at >= s.begin.load(std::memory_order_relaxed) &&
        at < s.end.load(std::memory_order_relaxed)) {
      for (size_t done = 0; done < s.length;) {
        const ssize_t n = write(STDERR_FILENO, s.message + done, s.length - done);
        if (n <= 0) break;
        done += size_t(n);
      }
      break;
    }
  }
  sigaction(SIGBUS, &g_previous, nullptr);
  // A fault re-executes the faulting read on return and so reaches the previous disposition with its own siginfo;
  // a SIGBUS sent by kill() or raise() must be sent again.
  if (info->si_code <= 0) raise(sig);
}

void install_handler() {
  struct sigaction sa;
  std::memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_sigbus;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGBUS, &sa, &g_previous);
}
#endif

void format(Slot& s, const std::string& path) {
  const char head[] = "lily: fatal: SIGBUS reading the memory-mapped weights file ";
  const char tail[] = ": it was truncated or overwritten in place while the model was loaded (replace a weights "
                      "file by writing a new file and renaming it over the old one)\n";
  const size_t room = sizeof s.message - sizeof head - sizeof tail;
  std::string shown = path.size() <= room ? path : "..." + path.substr(path.size() - (room - 3));
  std::string text = head + shown + tail;
  std::memcpy(s.message, text.data(), text.size());
  s.length = text.size();
}

}  // namespace

int add_mapped_file(const void* begin, size_t bytes, const std::string& path) {
  std::lock_guard<std::mutex> lock(g_mutex);
#ifdef LILY_HAS_SIGBUS_HANDLER
  static std::once_flag installed;
  std::call_once(installed, install_handler);
#endif
  for (int id = 0; id < kMaxMappedFiles; ++id) {
    Slot& s = g_slots[id];
    if (s.used.load(std::memory_order_relaxed)) continue;
    format(s, path);
    s.begin.store(uintptr_t(begin), std::memory_order_relaxed);
    s.end.store(uintptr_t(begin) + bytes, std::memory_order_relaxed);
    s.used.store(true, std::memory_order_release);
    return id;
  }
  return -1;
}

void remove_mapped_file(int id) {
  if (id < 0 || id >= kMaxMappedFiles) return;
  std::lock_guard<std::mutex> lock(g_mutex);
  g_slots[id].used.store(false, std::memory_order_release);
}

}  // namespace lily
